"""Hand-written token mixers that are recurrences written as Python loops over time steps.

Each replaces the decoder's attention (tests/zoo/handwritten_attention.py's skeleton) with a
causal mixer that walks the sequence one position at a time, its state carried from step to
step: the loop is unrolled in the trace, and context parallelism runs it by handing the state
rank to rank (passes/cp_recurrence.py, runtime/cp_recur.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.zoo.common import HIDDEN
from tests.zoo.handwritten_attention import decoder_with


class GatedLoop(nn.Module):
    """A gated linear recurrence h_t = a_t * h_{t-1} + (1 - a_t) * v_t from h_0 = 0, outputs
    stacked: the minimal RNN / linear-attention state update, written step by step."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):                                  # [B, T, C]
        a, v = torch.sigmoid(self.gate(x)), self.value(x)
        h, ys = torch.zeros_like(v[:, 0]), []              # [B, C]
        for t in range(x.shape[1]):
            h = a[:, t] * h + (1 - a[:, t]) * v[:, t]
            ys.append(torch.tanh(h))
        return self.out(torch.stack(ys, dim=1))


class TwoStateLoop(nn.Module):
    """A normalised decayed sum with two states (numerator, denominator) and a learned decay,
    outputs written into a buffer (`out[:, t] = ...`, RWKV's WKV form on CPU)."""

    def __init__(self):
        super().__init__()
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.decay = nn.Parameter(torch.linspace(-1.0, 1.0, HIDDEN))
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        k, v = torch.exp(self.key(x).clamp(max=5.0)), self.value(x)
        w = torch.sigmoid(self.decay)
        num, den = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0]) + 1.0
        out = torch.zeros_like(v)
        for t in range(x.shape[1]):
            num = w * num + k[:, t] * v[:, t]
            den = w * den + k[:, t]
            out[:, t] = num / den
        return self.out(out)


FACTORIES = {
    "hw_gated_loop": decoder_with(GatedLoop),
    "hw_two_state_loop": decoder_with(TwoStateLoop),
}
