"""Loops over time steps under cp (passes/cp_recurrence.py, runtime/cp_recur.py): small models
whose loops cp cannot hand rank to rank (each must be a one-line PlanError naming why), and
the job the multi-rank tests run on local gloo ranks."""
from __future__ import annotations

import torch

from tests.cp_shift_jobs import ShiftMix


class FinalState(ShiftMix):
    """h_t = 0.5 h_{t-1} + x_t from zeros, outputs stacked, and the final state read after the
    loop (added to every position): on a rank, the loop's last step is not the sequence's."""

    def forward(self, idx):
        x = self.emb(idx)
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = 0.5 * h + x[:, t]
            ys.append(h)
        return self.head(torch.stack(ys, 1) + h.unsqueeze(1))


class LookAhead(ShiftMix):
    """Each step also reads the next position (x[:, t + 1]): a position the block may not hold."""

    def forward(self, idx):
        x = self.emb(idx)
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            nxt = x[:, t + 1] if t + 1 < x.shape[1] else torch.zeros_like(x[:, 0])
            h = 0.5 * h + x[:, t] + nxt
            ys.append(h)
        return self.head(torch.stack(ys, 1))


class StepCounter(ShiftMix):
    """A decay that depends on the step's number (0.9 ** t): the steps are not one body."""

    def forward(self, idx):
        x = self.emb(idx)
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = (0.9 ** t) * h + x[:, t]
            ys.append(h)
        return self.head(torch.stack(ys, 1))


class FirstToken(ShiftMix):
    """CLS pooling: only position 0 is read (no loop)."""

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + x[:, 0].unsqueeze(1))


def loop_parity(archs: list, plan: str, steps: int = 3) -> dict:
    """Run on every rank: each zoo arch (2 rows of 8 tokens) under `plan`: (losses, grads)."""
    from tests.cp_factory_models import zoo_grads_parity
    return zoo_grads_parity(archs, plan, steps)
