"""Validation loss: forward only through the parallel model (no gradients, no update).

`pm.evaluate` runs the forward-only schedule with every module in eval mode (dropout off)
and returns the global batch's mean loss on every rank; the validation loss is the mean
over a fixed set of validation batches, the same ones at every evaluation, so the curve
moves only because the model does.
"""
from __future__ import annotations

from typing import Callable


def validation_loss(pm, val_batch: Callable[[int], tuple], batches: int) -> float:
    """Mean loss of pm over val_batch(0) .. val_batch(batches - 1) (every rank calls it)."""
    total = 0.0
    for i in range(batches):
        *inputs, target = val_batch(i)
        total += pm.evaluate(*inputs, target=target)
    return total / batches


def due(step: int, every: int, total: int) -> bool:
    """Evaluate after step `step` (1-based count of steps done): every N, and at the end."""
    return every > 0 and (step % every == 0 or step == total)
