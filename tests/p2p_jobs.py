"""Rank side of tests/test_local_p2p.py: pipeline steps with the shared-memory channels on
and off, and the channel driven directly."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch

GPT = dict(n_layer=4, n_embd=16, n_head=2, seq=8, batch=8)


def _use_dir(shm_dir: str | None, own_dir: str | None) -> None:
    """Channels' files in `shm_dir` (a test's own folder, so it can see what is left);
    rank 1 looks in `own_dir` instead, as a rank on another host would."""
    import torch.distributed as dist

    from threefold.runtime import local_p2p
    if shm_dir is not None:
        local_p2p.SHM_DIR = shm_dir
    if own_dir is not None and dist.get_rank() == 1:
        local_p2p.SHM_DIR = own_dir


def on_and_off(plans: list[str], steps: int, shm_dir: str | None = None, own_dir: str | None = None,
               ring_mb: str | None = None) -> list[dict]:
    """Each plan twice (THREEFOLD_LOCAL_P2P=1, then 0): the losses, this rank's gradients
    after the first step, and how many messages went through shared memory."""
    import threefold
    from tests.parity import load_workload
    torch.set_num_threads(1)
    _use_dir(shm_dir, own_dir)
    if ring_mb is not None:
        os.environ["THREEFOLD_LOCAL_P2P_MB"] = ring_mb
    out = []
    for plan in plans:
        for flag in ("1", "0"):
            os.environ["THREEFOLD_LOCAL_P2P"] = flag
            w = load_workload("gpt", **GPT)
            pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
            opt = pm.optimizer(torch.optim.SGD, lr=0.1)
            losses, grads = [], None
            for _ in range(3):
                opt.zero_grad()
                losses.append(pm.step(*w["inputs"], target=w["target"]))
                if grads is None:
                    grads = {k: p.grad.clone() for k, p in pm.engine.named_parameters() if p.grad is not None}
                opt.step()
            links = pm.engine._links[0] if pm.engine._links else None
            out.append({"plan": plan, "on": flag == "1", "losses": losses, "grads": grads,
                        "local": links.local_messages if links else 0,
                        "gloo": links.gloo_messages if links else 0})
    return out


def reference(steps: int = 3) -> list[float]:
    from tests.parity import load_workload, sgd_losses
    return sgd_losses(load_workload("gpt", **GPT), steps)


def channel_unit(shm_dir: str, ring_mb: str) -> dict:
    """Rank 0 sends rank 1 many messages through one channel (a ring of 4 slots, so it
    wraps many times; every 7th message is larger than the slot and goes through gloo);
    rank 1 receives them, checks every byte, then waits for one that never comes."""
    import torch.distributed as dist

    from threefold.runtime import comm, local_p2p
    torch.set_num_threads(1)
    local_p2p.SHM_DIR = shm_dir
    os.environ["THREEFOLD_LOCAL_P2P_MB"] = ring_mb
    small, big = (3, 5), (40, 40)                     # 64 B (one aligned tensor) vs 6400 B
    n = 60
    # sized for "steps" of 3 small messages and a big one: 4 slots of 64 B within the budget
    # (the big one is over it: gloo); 60 messages wrap the ring, consumed in order
    links = local_p2p.open_links({(0, 1): [64, 64, 64, 6400]})
    assert links is not None
    me = dist.get_rank()
    result: dict = {}
    if me == 0:
        end = links.senders[1]
        result["slots"], result["slot_bytes"] = end.slots, end.slot_bytes
        sends = [comm.send([torch.full(big if i % 7 == 6 else small, float(i))], 1, f"message {i}", links)
                 for i in range(n)]
        for s in sends:
            s.wait()
        result["local"], result["gloo"] = links.local_messages, links.gloo_messages
        dist.barrier()
    else:
        got = []
        for lo in range(0, n, 2):      # posted in order; of each pair the later one waited for first
            pair = [comm.post_recv([(big if i % 7 == 6 else small, torch.float32)], 0, f"message {i}",
                                   torch.device("cpu"), None, links) for i in (lo, lo + 1)]
            second, first = pair[1].wait()[0], pair[0].wait()[0]
            got += [first, second]
        result["ok"] = all(bool((t == float(i)).all()) and t.shape == (big if i % 7 == 6 else small)
                           for i, t in enumerate(got))
        comm.wait_grace[:] = [timedelta(seconds=2)]      # a message that never comes: bounded
        start = time.monotonic()
        try:
            comm.post_recv([(small, torch.float32)], 0, "a message never sent", torch.device("cpu"),
                           None, links).wait()
        except comm.RankFailure as exc:
            result["timeout"] = (str(exc), time.monotonic() - start)
        comm.wait_grace[:] = []
        dist.barrier()
    links.close()
    return result


def die_mid_step(victim: int, shm_dir: str):
    """pp=4: one healthy step, then `victim` is killed (SIGKILL) in its third forward."""
    import threefold
    from tests.dying import kill_in_forward, step_timing_failure
    from tests.parity import load_workload
    torch.set_num_threads(1)
    _use_dir(shm_dir, None)
    w = load_workload("gpt", **GPT)
    pm = threefold.parallelize(w["model"], "pp=4,m=4", w["inputs"], w["loss_fn"], target=w["target"])
    pm.step(*w["inputs"], target=w["target"])
    assert pm.engine._links[0] is not None and pm.engine._links[0].local_messages > 0
    if torch.distributed.get_rank() == victim:
        kill_in_forward(pm)   # during the forward of microbatch 2 of the next step
    return step_timing_failure(pm, w)
