"""MoEs whose experts are einsums over stacked expert weights (issue 40): the dense-expert
pass reads the einsum's equation for the experts' letter (passes/dense_experts.py).

  hw_moe_einsum       every token routed to every expert by its top-1 router score, kept per
                      sequence as [B, E, T, C] (the experts on dim 1, not 0), a SwiGLU as
                      einsum('betc,ecf->betf') / einsum('betf,efc->betc') against [E, C, 2F]
                      and [E, F, C] parameters, summed over the experts. `matmul=True` writes
                      the products as `x @ w` (matmul broadcasting E against x's dim 1).
                      `mixture=True`: every expert on every token, 'btc,ecf->betf' (or
                      [T, C] @ [E, C, 2F] with `matmul`), outputs weighted by the scores.
                      `ellipsis=True`: '...tc,...cf->...tf', as mixture-of-experts writes it.
  hw_moe_einsum_soft  Soft MoE with stacked experts: every slot a softmax-weighted mix of the
                      sequence's tokens ([B, E, P, D]: E experts of P slots), each expert's
                      GELU MLP as einsum('bepd,edf->bepf') / einsum('bepf,efd->bepd'), slots
                      mixed back into tokens by a second softmax. `slots=1` gives the one-slot
                      form 'bnd,ndf->bnf'.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, VOCAB, token_batch, workload


class EinsumExperts(nn.Module):
    def __init__(self, experts: int = 4, ffn: int = 24, matmul: bool = False, mixture: bool = False,
                 ellipsis: bool = False):
        super().__init__()
        self.experts, self.matmul, self.mixture = experts, matmul, mixture
        self.eqs = ("...tc,...cf->...tf",) * 2 if ellipsis else ("betc,ecf->betf", "betf,efc->betc")
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, HIDDEN, 2 * ffn) * HIDDEN ** -0.5)   # [E, C, 2F]
        self.w_out = nn.Parameter(torch.randn(experts, ffn, HIDDEN) * ffn ** -0.5)        # [E, F, C]

    def forward(self, x):                                               # [B, T, C]
        logits = self.router(x)                                         # [B, T, E]
        top, idx = logits.topk(1, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter(-1, idx, top).sigmoid()
        if self.mixture:
            return self._mixture(x, scores)
        routed = x.unsqueeze(1) * scores.transpose(1, 2).unsqueeze(-1)  # [B, E, T, C]
        if self.matmul:
            g, u = (routed @ self.w_in).chunk(2, dim=-1)
            y = (F.silu(g) * u) @ self.w_out
        else:
            g, u = torch.einsum(self.eqs[0], routed, self.w_in).chunk(2, dim=-1)
            y = torch.einsum(self.eqs[1], F.silu(g) * u, self.w_out)
        return y.sum(1)                                                 # [B, T, C]

    def _mixture(self, x, scores):
        """Every expert on every token (x read whole by each), weighted by its score."""
        b, t, c = x.shape
        if self.matmul:
            tokens = x.reshape(-1, c)                                   # [N, C]
            g, u = (tokens @ self.w_in).chunk(2, dim=-1)                # [E, N, F] each
            y = (F.silu(g) * u) @ self.w_out                            # [E, N, C]
            return (y * scores.reshape(-1, self.experts).t().unsqueeze(-1)).sum(0).reshape(b, t, c)
        g, u = torch.einsum("btc,ecf->betf", x, self.w_in).chunk(2, dim=-1)
        y = torch.einsum("betf,efc->betc", F.silu(g) * u, self.w_out)  # [B, E, T, C]
        return (y * scores.transpose(1, 2).unsqueeze(-1)).sum(1)


class SoftExperts(nn.Module):
    def __init__(self, experts: int = 4, slots: int = 2, ffn: int = 48):
        super().__init__()
        self.experts, self.slots = experts, slots
        self.phi = nn.Parameter(torch.randn(HIDDEN, experts * slots) * HIDDEN ** -0.5)    # [D, E*P]
        self.w1 = nn.Parameter(torch.randn(experts, HIDDEN, ffn) * HIDDEN ** -0.5)        # [E, D, F]
        self.w2 = nn.Parameter(torch.randn(experts, ffn, HIDDEN) * ffn ** -0.5)           # [E, F, D]

    def forward(self, x):                                               # [B, T, D]
        logits = torch.einsum("btd,dn->btn", x, self.phi)               # [B, T, E*P]
        dispatch, combine = logits.softmax(dim=1), logits.softmax(dim=-1)
        slots = torch.einsum("btn,btd->bnd", dispatch, x)               # [B, E*P, D]
        if self.slots == 1:
            h = F.gelu(torch.einsum("bnd,ndf->bnf", slots, self.w1))
            out = torch.einsum("bnf,nfd->bnd", h, self.w2)
        else:
            slots = slots.unflatten(1, (self.experts, self.slots))      # [B, E, P, D]
            h = F.gelu(torch.einsum("bepd,edf->bepf", slots, self.w1))
            out = torch.einsum("bepf,efd->bepd", h, self.w2).flatten(1, 2)
        return torch.einsum("btn,bnd->btd", combine, out)


class EinsumMoELM(nn.Module):
    def __init__(self, block, layers: int = 2, **kw):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(layers))
        self.moes = nn.ModuleList(block(**kw) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def einsum_moe(seed: int = 0, **kw):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(EinsumMoELM(EinsumExperts, **kw).train(), (inputs,), target)


def soft_einsum_moe(seed: int = 0, **kw):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(EinsumMoELM(SoftExperts, **kw).train(), (inputs,), target)


FACTORIES = {"hw_moe_einsum": einsum_moe, "hw_moe_einsum_soft": soft_einsum_moe}
