"""Tiny MoEs whose experts are separate modules applied one by one (tests/test_ep_modules.py).

  slot_experts    Soft-MoE-like slots: the tokens are cut into one piece per expert along the
                  sequence (chunk), each expert runs on its piece, the outputs are concatenated
  dense_mixture   every expert sees every token; the outputs, each scaled by its softmax
                  router weight, are summed (Python `sum`); the experts are plain attributes
                  with unrelated names, not a ModuleList
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ, BATCH, EXPERTS = 32, 16, 8, 4, 4


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))


class SlotExperts(nn.Module):
    def __init__(self, experts: int = EXPERTS):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.experts = nn.ModuleList(_expert() for _ in range(experts))

    def forward(self, idx):
        x = self.emb(idx)                                               # [b, 8, 16]
        pieces = x.chunk(len(self.experts), dim=1)                      # 8 / E positions per expert
        y = torch.cat([e(p) for e, p in zip(self.experts, pieces)], dim=1)
        return self.head(x + y)


class DenseMixture(nn.Module):
    NAMES = ("north", "south", "east", "west")

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.router = nn.Linear(HIDDEN, len(self.NAMES), bias=False)
        for name in self.NAMES:
            setattr(self, name, _expert())

    def forward(self, idx):
        x = self.emb(idx)                                               # [b, 8, 16]
        gates = self.router(x).softmax(dim=-1)                          # [b, 8, E]
        y = sum(gates[..., e:e + 1] * getattr(self, n)(x) for e, n in enumerate(self.NAMES))
        return self.head(x + y)


def _loss(y, t):
    return F.cross_entropy(y.reshape(-1, VOCAB), t.reshape(-1))


def _workload(model: nn.Module, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"model": model.train(), "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": _loss}


def slot_experts(seed: int = 0, experts: int = EXPERTS) -> dict:
    torch.manual_seed(seed)
    return _workload(SlotExperts(experts), seed)


def dense_mixture(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return _workload(DenseMixture(), seed)


FACTORIES = {"slot_experts": slot_experts, "dense_mixture": dense_mixture}
