"""Hand-written token mixers that are recurrences written as scans over the sequence.

Each replaces the decoder's attention (tests/zoo/handwritten_attention.py's skeleton) with a
causal mixer whose parallel form is a cumulative sum, product or log-sum-exp over time: the
linear-attention / gated-RNN family that context parallelism runs by handing each block the
carry of the blocks before it (runtime/cp_scan.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import HIDDEN
from tests.zoo.handwritten_attention import HEADS, decoder_with


class LinearAttention(nn.Module):
    """Causal linear attention (Katharopoulos et al. 2020): feature map elu+1, the state
    sum_{s<=t} phi(k_s) v_s^T and the normaliser sum_{s<=t} phi(k_s) as cumsums over time."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS) for t in self.qkv(x).split(C, dim=-1))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        state = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=1)      # [B, T, H, d, d]
        norm = torch.cumsum(k, dim=1)                                       # [B, T, H, d]
        y = (q.unsqueeze(-2) @ state).squeeze(-2) / (q * norm).sum(-1, keepdim=True)
        return self.out(y.reshape(B, T, C))


class MinGRU(nn.Module):
    """minGRU (Feng et al. 2024) in log space: h_t = (1 - z_t) h_{t-1} + z_t g(h~_t), run as
    log h = a* + logcumsumexp(log values - a*), a* = cumsum(log(1 - z)) over time."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, HIDDEN)
        self.cand = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    @staticmethod
    def _log_g(x):
        return torch.where(x >= 0, torch.log(F.relu(x) + 0.5), -F.softplus(-x))

    def forward(self, x):
        z = self.gate(x)
        log_coeffs, log_z = -F.softplus(z), -F.softplus(-z)
        a_star = torch.cumsum(log_coeffs, dim=1)
        log_h = a_star + torch.logcumsumexp(log_z + self._log_g(self.cand(x)) - a_star, dim=1)
        return self.out(torch.exp(log_h))


class DecayedCumprod(nn.Module):
    """A per-channel decayed running mean written with cumprod: h_t = a_t h_{t-1} + v_t,
    h = A * cumsum(v / A) with A = cumprod(a) over time, a in (0.5, 1)."""

    def __init__(self):
        super().__init__()
        self.decay = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        a = 0.5 + 0.5 * torch.sigmoid(self.decay(x))
        A = torch.cumprod(a, dim=1)
        return self.out(A * torch.cumsum(self.value(x) / A, dim=1))


FACTORIES = {
    "hw_linear_attention": decoder_with(LinearAttention),
    "hw_min_gru": decoder_with(MinGRU),
    "hw_decay_cumprod": decoder_with(DecayedCumprod),
}
