"""Rank side of tests/test_dp_sync.py: clipped SGD steps that record every all-reduce."""
from __future__ import annotations

import torch

from tests.cp_jobs import ignore_index_workload

LR, MAX_NORM = 0.1, 0.5


def clipped_losses(plan: str, steps: int, own_shm_dir: str | None = None) -> dict:
    """(losses, norms, the `what` of every all-reduce issued during the steps) under `plan`
    for the ignore-index GPT (its dp and cp ranks count different numbers of tokens).
    `own_shm_dir`: rank 1 looks for shared memory there, as a rank on another host would
    (runtime/local_reduce.py must then fall back to gloo for every rank)."""
    import torch.distributed as dist

    import threefold
    from threefold.runtime import comm, local_reduce
    torch.set_num_threads(1)
    if own_shm_dir is not None and dist.get_rank() == 1:
        local_reduce.SHM_DIR = own_shm_dir
    w = ignore_index_workload()
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    opt = pm.optimizer(torch.optim.SGD, lr=LR)
    issued, real = [], comm.all_reduce

    def counting(t, group, what, *args, **kwargs):
        issued.append(what)
        return real(t, group, what, *args, **kwargs)
    comm.all_reduce = counting
    losses, norms = [], []
    try:
        for _ in range(steps):
            opt.zero_grad()
            losses.append(pm.step(*w["inputs"], target=w["target"]))
            norms.append(pm.clip_grad_norm_(MAX_NORM))
            opt.step()
    finally:
        comm.all_reduce = real
    return {"losses": losses, "norms": norms, "all_reduces": issued}


def reference(steps: int) -> tuple[list[float], list[float]]:
    w = ignore_index_workload()
    model = w["model"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
    return losses, norms
