"""Learning rate per step: linear warmup to the peak, then cosine decay to min_lr.

The shape of nanoGPT's and Megatron's schedule. Steps count from 0 (the first optimizer
step); warmup reaches the peak at step `warmup` (so step 0 already trains, at lr/(warmup+1)),
the cosine runs from `warmup` to the last step `total - 1`, where it lands on min_lr.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    lr: float          # peak learning rate
    min_lr: float      # learning rate at the last step
    warmup: int        # linear warmup steps
    total: int         # steps in the run

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        span = self.total - 1 - self.warmup
        if span <= 0:
            return self.lr
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)


def set_lr(optimizer, lr: float) -> None:
    """Every parameter group trains at `lr` (groups differ in weight decay only)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
