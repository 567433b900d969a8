"""Stop (or skip) a training step whose loss or gradient norm is not finite.

The loss is identical on every rank; gradient shards differ, so their finiteness is agreed
with one all-reduce of a flag, and every rank takes the same decision.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

STOP_HINT = "lower --lr, or pass --skip-nonfinite to skip such steps"


def nonfinite(loss: float, params) -> str | None:
    """None when the step is finite everywhere, else what was not ('loss nan', 'gradient norm')."""
    if not math.isfinite(loss):
        return f"loss {loss}"
    bad = 0.0
    for p in params:
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            bad = 1.0
            break
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from threefold.runtime import comm   # lazy: start-up: a command loads runtime.comm only when it runs
        flag = torch.tensor([bad])
        comm.all_reduce(flag, None, "the finite-gradient check")
        bad = flag.item()
    return "gradient norm (inf or nan)" if bad else None


def stop_message(command: str, step: int, what: str) -> str:
    return f"threefold {command}: step {step}: non-finite {what}; training stopped ({STOP_HINT})"
