"""Hand-written MoEs whose experts compute densely, as Llama 4's do: every token repeated once
per expert and scaled by its router score, then batched matmuls over stacked [E, in, out]
expert weights, and the sum over experts (passes/dense_experts.py finds them from structure).

`interleaved=True` stores gate and up in one [E, C, 2F] parameter interleaved along the
features and reads them between the batched matmuls as `w[..., ::2]` / `w[..., 1::2]`
(issue 40 item 3), with per-expert biases sliced the same way and a clamp. `matmul=True`
writes the products with `@` (aten.matmul) instead of bmm."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, VOCAB, token_batch, workload


class DenseExperts(nn.Module):
    def __init__(self, experts: int = 4, ffn: int = 24, interleaved: bool = False, matmul: bool = False):
        super().__init__()
        self.experts, self.interleaved, self.matmul = experts, interleaved, matmul
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, HIDDEN, 2 * ffn) * HIDDEN ** -0.5)   # [E, C, 2F]
        self.down = nn.Parameter(torch.randn(experts, ffn, HIDDEN) * ffn ** -0.5)             # [E, F, C]
        if interleaved:   # GPT-OSS-like: per-expert biases, read as [E, 1, F] beside the slices
            self.gate_up_bias = nn.Parameter(torch.randn(experts, 2 * ffn) * 0.1)             # [E, 2F]

    def _mm(self, a, b):
        return a @ b if self.matmul else torch.bmm(a, b)

    def forward(self, x):
        b, t, c = x.shape
        tokens = x.reshape(-1, c)                                       # [T, C]
        logits = self.router(tokens)
        top, idx = logits.topk(1, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter(1, idx, top).sigmoid()   # [T, E]
        # [E, T, C]: expert e's copy of every token, scaled by its score (Llama 4 tiles the
        # tokens with repeat(E, 1) into [E*T, C] first, which dp's row rules cannot follow)
        routed = tokens.unsqueeze(0).expand(self.experts, -1, -1) * scores.t().unsqueeze(-1)
        if self.interleaved:
            g = self._mm(routed, self.gate_up[..., ::2]) + self.gate_up_bias[:, None, ::2]   # even columns
            u = self._mm(routed, self.gate_up[..., 1::2]) + self.gate_up_bias[:, None, 1::2]  # and odd ones
            g = g.clamp(max=7.0)                                        # a clamped SwiGLU
        else:
            g, u = self._mm(routed, self.gate_up).chunk(2, dim=-1)
        y = self._mm(F.silu(g) * u, self.down)                          # [E, T, C]
        return y.sum(0).reshape(b, t, c)


class DenseMoELM(nn.Module):
    def __init__(self, layers: int = 2, **kw):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(layers))
        self.moes = nn.ModuleList(DenseExperts(**kw) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def dense_moe(seed: int = 0, **kw):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(DenseMoELM(**kw).train(), (inputs,), target)
