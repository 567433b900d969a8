"""A hand-written top-2 mixture of experts in the grouped form: a softmax router, top-2,
token-expert rows sorted by expert, one stacked weight per projection applied with a
grouped matmul (its own custom op, as Hugging Face writes one), and the weighted combine.
Nothing in it is named for threefold: expert parallelism must find it from the graph."""
from __future__ import annotations

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
