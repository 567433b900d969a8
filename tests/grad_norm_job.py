"""Rank side of the gradient-norm parity tests: SGD steps clipped by the global norm."""
from __future__ import annotations

import torch

from tests.parity import load_workload

LR = 0.1


def clipped_steps(w: dict, step_fn, opt, clip, steps: int):
    """(losses, norms before clipping) of `steps` clipped optimizer steps."""
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(step_fn())
        norms.append(float(clip()))
        opt.step()
    return losses, norms


def reference(kwargs: dict, steps: int, max_norm: float):
    w = load_workload("gpt", **kwargs)
    model = w["model"]

    def step():
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        return loss.item()
    params = [p for p in model.parameters() if p.requires_grad]
    return clipped_steps(w, step, torch.optim.SGD(params, lr=LR),
                         lambda: torch.nn.utils.clip_grad_norm_(params, max_norm), steps)


def parallel(cases: list[tuple[str, dict]], steps: int, max_norm: float) -> list[dict]:
    """Every (plan, workload kwargs) case in turn, on every rank of one launched job."""
    import threefold
    torch.set_num_threads(1)
    out = []
    for plan, kwargs in cases:
        w = load_workload("gpt", **kwargs)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        losses, norms = clipped_steps(w, lambda: pm.step(*w["inputs"], target=w["target"]),
                                      pm.optimizer(torch.optim.SGD, lr=LR),   # zero=1: sharded
                                      lambda: pm.clip_grad_norm_(max_norm), steps)
        out.append({"plan": plan, "losses": losses, "norms": norms})
    return out
