"""A top-2 MoE whose gate and up projections are one stacked parameter, interleaved along
the output features ([E, C, 2F]: gate0, up0, gate1, up1, ...) and read between the expert
matmuls as two slices of the weight itself, `w[..., ::2]` and `w[..., 1::2]`, then a SwiGLU
and the down projection (the grouped matmul of tests/zoo/handwritten_moe.py). Expert
parallelism must keep the slices with the experts' weights (issue 40 item 3)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo import handwritten_moe as _gmm   # registers zoo_moe::gmm
from tests.zoo.common import HIDDEN, VOCAB, token_batch, workload


class InterleavedMoE(_gmm.Top2MoE):
    def __init__(self, experts: int = 4, hidden: int = 48):
        super().__init__(experts, hidden)
        self.w_in = nn.Parameter(torch.randn(experts, HIDDEN, 2 * hidden) * HIDDEN ** -0.5)   # [E, C, 2F]
        self.w_out = nn.Parameter(torch.randn(experts, hidden, HIDDEN) * hidden ** -0.5)      # [E, F, C]

    def forward(self, x):
        b, t, c = x.shape
        tokens = x.reshape(-1, c)
        probs = self.router(tokens).softmax(-1)
        gate, expert = probs.topk(2, dim=-1)
        order = expert.reshape(-1).argsort(stable=True)
        rows = tokens[order // 2]
        offs = F.one_hot(expert.reshape(-1), self.experts).sum(0).cumsum(0).to(torch.int32)
        g = torch.ops.zoo_moe.gmm(rows, self.w_in[..., ::2], offs)     # the weight's even columns
        u = torch.ops.zoo_moe.gmm(rows, self.w_in[..., 1::2], offs)    # and its odd ones
        h = F.silu(g).clamp(max=7.0) * (u + 1)                          # GPT-OSS-like gate
        y = torch.ops.zoo_moe.gmm(h, self.w_out, offs)
        y = y * gate.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, order // 2, y).reshape(b, t, c)


class InterleavedMoELM(nn.Module):
    def __init__(self, layers: int = 2, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(layers))
        self.moes = nn.ModuleList(InterleavedMoE(experts) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def interleaved_moe(seed: int = 0, experts: int = 4):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(InterleavedMoELM(experts=experts).train(), (inputs,), target)
