"""Hand-written models whose ops couple the rows of the batch, or whose forward writes a
buffer (issue 21): what a split batch can and cannot compute exactly.

  hw_moe_capacity   top-2 MoE with expert capacity: a cumsum over every token of the batch
                    decides which tokens are dropped (PlanError when m*dp > 1)
  hw_infonce        contrastive loss over the in-batch B x B similarity (PlanError)
  hw_step_counter   a step-counter buffer read by forward after its update (exact: once per step)
  hw_running_buffer a running mean of the activations kept in a buffer (PlanError)
  hw_ste            straight-through estimator, a custom autograd.Function (PlanError:
                    torch.export would drop its backward)
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import BATCH, HIDDEN, VOCAB, token_batch, workload


class CapacityMoE(nn.Module):
    """Embedding, one top-2 MoE layer with 4 dense experts and capacity 0.5 * N * k / E
    tokens per expert (first come, first served over the flattened batch), LM head."""

    def __init__(self, experts: int = 4, k: int = 2, capacity_factor: float = 0.5):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, HIDDEN, 2 * HIDDEN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * HIDDEN, HIDDEN) * 0.1)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.experts, self.k, self.factor = experts, k, capacity_factor

    def forward(self, idx):
        x = self.emb(idx)                                    # [B, T, H]
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)                         # [N, H]
        probs = F.softmax(self.router(tokens), dim=-1)       # [N, E]
        _, chosen = probs.topk(self.k, dim=-1)               # [N, k]
        mask = F.one_hot(chosen, self.experts).sum(1).float()  # [N, E]
        position = torch.cumsum(mask, dim=0) * mask - 1      # queue position over ALL tokens
        capacity = math.ceil(self.factor * b * t * self.k / self.experts)
        weights = probs * mask * (position < capacity)       # dropped tokens weigh 0
        hidden = torch.einsum("nh,ehf->enf", tokens, self.w1).relu()
        out = torch.einsum("ne,enh->nh", weights, torch.einsum("enf,efh->enh", hidden, self.w2))
        return self.head((tokens + out).reshape(b, t, h))


class TwoTower(nn.Module):
    """Two encoders; the loss contrasts every pair of rows (CLIP / InfoNCE)."""

    def __init__(self, features: int = 16, dim: int = 8):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(features, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, dim))
        self.b = nn.Sequential(nn.Linear(features, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, dim))

    def forward(self, x, y):
        return self.a(x), self.b(y)


def infonce_loss(out, target):
    za, zb = out
    logits = F.normalize(za, dim=-1) @ F.normalize(zb, dim=-1).T / 0.1   # [B, B]
    return F.cross_entropy(logits, target)


class CounterLM(nn.Module):
    """A tiny LM with a step counter buffer that forward increments and then reads (a
    schedule that depends on the step, as warm-up or noise annealing code does)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, idx):
        self.step += 1
        h = self.emb(idx) * (1.0 + 0.5 * self.step)      # reads the updated counter
        for blk in self.blocks:
            h = h + torch.tanh(blk(h))
        return self.head(h)


class RunningMeanLM(nn.Module):
    """Keeps a running mean of its hidden states in a buffer (EMA from the batch)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("running", torch.zeros(HIDDEN))

    def forward(self, idx):
        h = self.emb(idx)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * h.mean(dim=(0, 1)))
        for blk in self.blocks:
            h = h + torch.tanh(blk(h - self.running))
        return self.head(h)


class RoundSTE(torch.autograd.Function):
    """round() forward, identity backward: the straight-through estimator."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class QuantLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, RoundSTE.apply(self.weight * 8) / 8, self.bias)


class STELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(QuantLinear(HIDDEN, HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        h = self.emb(idx)
        for blk in self.blocks:
            h = h + torch.tanh(blk(h))
        return self.head(h)


def moe_capacity(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(CapacityMoE(), (inputs,), target)


def infonce(seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(2 * BATCH, 16, generator=g), torch.randn(2 * BATCH, 16, generator=g)
    return workload(TwoTower(), (x, y), torch.arange(2 * BATCH), infonce_loss)


def step_counter(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(CounterLM(), (inputs,), target)


def running_buffer(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(RunningMeanLM(), (inputs,), target)


def ste(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(STELM(), (inputs,), target)


FACTORIES = {
    "hw_moe_capacity": moe_capacity,
    "hw_infonce": infonce,
    "hw_step_counter": step_counter,
    "hw_running_buffer": running_buffer,
    "hw_ste": ste,
}
