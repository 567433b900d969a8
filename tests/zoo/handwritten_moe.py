"""A hand-written top-2 mixture of experts in the grouped form: a softmax router, top-2,
token-expert rows sorted by expert, one stacked weight per projection applied with a
grouped matmul (its own custom op, as Hugging Face writes one), and the weighted combine.
Nothing in it is named for threefold: expert parallelism must find it from the graph."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, VOCAB, token_batch, workload


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows x[offs[e-1]:offs[e]] times w[e], for every expert e."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _gmm_fake(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


def _gmm_bwd(x, w, offs, grad):
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        gx[start:end] = grad[start:end] @ w[e].T
        gw[e] = x[start:end].T @ grad[start:end]
        start = end
    return gx, gw


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx, gw = torch.ops.zoo_moe.gmm_backward(x, w, ctx.offs, grad)
    return gx, gw, None


if not hasattr(torch.ops.zoo_moe, "gmm"):
    torch.library.custom_op("zoo_moe::gmm", _gmm, mutates_args=(),
                            schema="(Tensor x, Tensor w, Tensor offs) -> Tensor")
    torch.library.register_fake("zoo_moe::gmm", _gmm_fake)
    torch.library.register_autograd("zoo_moe::gmm", _backward, setup_context=_setup)
    torch.library.custom_op("zoo_moe::gmm_backward", _gmm_bwd, mutates_args=(),
                            schema="(Tensor x, Tensor w, Tensor offs, Tensor grad) -> (Tensor, Tensor)")
    torch.library.register_fake("zoo_moe::gmm_backward", lambda x, w, offs, g: (torch.empty_like(x),
                                                                                torch.empty_like(w)))


class Top2MoE(nn.Module):
    """[b, t, C] -> [b, t, C]: E experts (GELU MLPs, stacked weights), top-2 routing."""

    def __init__(self, experts: int = 4, hidden: int = 64):
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, HIDDEN, hidden) * HIDDEN ** -0.5)   # [E, C, F]
        self.w_out = nn.Parameter(torch.randn(experts, hidden, HIDDEN) * hidden ** -0.5)  # [E, F, C]

    def forward(self, x):
        b, t, c = x.shape
        tokens = x.reshape(-1, c)                                    # [N, C]
        probs = self.router(tokens).softmax(-1)
        gate, expert = probs.topk(2, dim=-1)                         # [N, 2]
        gate = gate / gate.sum(-1, keepdim=True)
        order = expert.reshape(-1).argsort(stable=True)              # token-expert rows by expert
        rows = tokens[order // 2]                                    # [2N, C]
        counts = F.one_hot(expert.reshape(-1), self.experts).sum(0)     # rows per expert
        offs = counts.cumsum(0).to(torch.int32)                      # where each expert's rows end
        h = F.gelu(torch.ops.zoo_moe.gmm(rows, self.w_in, offs))
        y = torch.ops.zoo_moe.gmm(h, self.w_out, offs)               # [2N, C]
        y = y * gate.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, order // 2, y)   # back to tokens, summed
        return out.reshape(b, t, c)


class MoELM(nn.Module):
    def __init__(self, layers: int = 2, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(layers))
        self.moes = nn.ModuleList(Top2MoE(experts) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def top2_moe(seed: int = 0, experts: int = 4):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(MoELM(experts=experts).train(), (inputs,), target)


class LoopMoE(nn.Module):
    """The older Hugging Face form: a ModuleList of experts, each picking its tokens with
    torch.where (a data-dependent size): refused with one line (passes/static_shapes.py)."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(experts))

    def forward(self, x):
        b, t, c = x.shape
        x = x.reshape(-1, c)
        gate, expert = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, layer in enumerate(self.experts):
            tok, slot = torch.where(expert == e)
            out = out.index_add(0, tok, layer(x[tok]) * gate[tok, slot, None])
        return out.reshape(b, t, c)


def loop_moe(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    model = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), LoopMoE(), nn.Linear(HIDDEN, VOCAB))
    return workload(model, (inputs,), target)


class CapacityTop2MoE(Top2MoE):
    """Top2MoE with expert capacity, GShard / Switch style: a (token, slot) pick's place in
    its expert's queue is a cumsum over the layer's tokens in order; picks at or past
    `capacity = ceil(factor x N x 2 / E)` are dropped: sorted past the last expert's rows
    (not computed) and weighted 0 in the combine. Optionally returns the Switch
    load-balancing loss aux = E x sum_e f_e x P_e over the same tokens."""

    def __init__(self, experts: int = 4, hidden: int = 64, factor: float = 0.75):
        super().__init__(experts, hidden)
        self.factor = factor

    def forward(self, x):
        b, t, c = x.shape
        tokens = x.reshape(-1, c)                                    # [N, C]
        probs = self.router(tokens).softmax(-1)
        gate, expert = probs.topk(2, dim=-1)                         # [N, 2]
        gate = gate / gate.sum(-1, keepdim=True)
        picks = F.one_hot(expert.reshape(-1), self.experts)          # [2N, E], token-major
        place = ((picks.cumsum(0) - 1) * picks).sum(-1)              # queue position per pick
        capacity = math.ceil(self.factor * tokens.shape[0] * 2 / self.experts)
        keep = place < capacity                                      # [2N]
        key = torch.where(keep, expert.reshape(-1), self.experts)    # dropped picks sort last
        order = key.argsort(stable=True)
        rows = tokens[order // 2]                                    # [2N, C]
        counts = (picks * keep.unsqueeze(-1)).sum(0)                 # kept rows per expert
        offs = counts.cumsum(0).to(torch.int32)                      # offs[-1] <= 2N
        h = F.gelu(torch.ops.zoo_moe.gmm(rows, self.w_in, offs))
        y = torch.ops.zoo_moe.gmm(h, self.w_out, offs)               # rows past offs[-1]: 0
        y = y * (gate.reshape(-1) * keep)[order].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, order // 2, y)
        f = picks.float().mean(0) / 2                                # fraction of picks per expert
        aux = self.experts * (f * probs.mean(0)).sum()
        return out.reshape(b, t, c), aux


class CapacityMoELM(nn.Module):
    """[B, T] -> (logits, summed aux loss of the MoE layers)."""

    def __init__(self, layers: int = 2, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(layers))
        self.moes = nn.ModuleList(CapacityTop2MoE(experts) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x, aux = self.embed(idx), 0.0
        for norm, moe in zip(self.norms, self.moes):
            y, a = moe(norm(x))
            x, aux = x + y, aux + a
        return self.head(x), aux


def capacity_moe(seed: int = 0, aux_coef: float = 0.0):
    """The capacity MoE LM; `aux_coef` > 0 adds the router's load-balancing loss."""
    from tests.zoo.common import lm_loss
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    w = workload(CapacityMoELM().train(), (inputs,), target,
                 lambda out, t: lm_loss(out[0], t) + aux_coef * out[1])
    return {**w, "batch_dims": (0, 0)}   # capacity and aux mix every row: the batch dim is stated


def dropped_picks(model: CapacityMoELM, idx: torch.Tensor) -> int:
    """(token, slot) picks the first MoE layer drops for this batch (what the tests check
    is not zero, so the capacity path runs)."""
    moe = model.moes[0]
    with torch.no_grad():
        tokens = model.norms[0](model.embed(idx)).reshape(-1, HIDDEN)
        expert = moe.router(tokens).softmax(-1).topk(2, dim=-1).indices.reshape(-1)
        picks = F.one_hot(expert, moe.experts)
        place = ((picks.cumsum(0) - 1) * picks).sum(-1)
        return int((place >= math.ceil(moe.factor * tokens.shape[0] * 2 / moe.experts)).sum())
