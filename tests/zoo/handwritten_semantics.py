"""Hand-written models about training semantics rather than layouts: losses that are not an
equal-weight mean over rows, frozen parameters, in-place ops on block inputs, dropout
masks across stages, and BatchNorm statistics."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import BATCH, HIDDEN, LAYERS, VOCAB, token_batch, workload
from tests.zoo.handwritten_attention import NanoGPTAttention, TinyDecoder


def sum_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum")


def smoothed_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), label_smoothing=0.1)


def _decoder(seed: int):
    torch.manual_seed(seed)
    return TinyDecoder(NanoGPTAttention).train()


def sum_reduction(seed: int = 0):
    inputs, target = token_batch(seed=seed)
    return workload(_decoder(seed), (inputs,), target, sum_loss)


def label_smoothing(seed: int = 0):
    inputs, target = token_batch(seed=seed)
    return workload(_decoder(seed), (inputs,), target, smoothed_loss)


def frozen_params(seed: int = 0):
    """Token embedding and the whole first block frozen: they must not move."""
    model = _decoder(seed)
    for p in list(model.wte.parameters()) + list(model.blocks[0].parameters()):
        p.requires_grad_(False)
    inputs, target = token_batch(seed=seed)
    return workload(model, (inputs,), target)


class InPlaceSkipBlock(nn.Module):
    """`h += a` on the block input itself (legal in eager: relu saves its output, not h), so
    on a later pipeline stage the in-place add hits the received boundary value."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h):
        a = self.fc2(torch.relu(self.fc1(torch.relu(h))))
        h += a
        return h


class InPlaceSkipLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(InPlaceSkipBlock() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def inplace_skip(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(InPlaceSkipLM().train(), (inputs,), target)


class GainDropoutBlock(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.gain = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, h):
        return self.drop(h) * self.gain


class TwoDropoutProbe(nn.Module):
    """Four identically shaped dropouts (p=0.5) multiplied in series, d_i in {0, 2}.
    Independent masks give E[prod d_i^2] = 2^4 = 16; if two stages repeat each other's
    masks (d0 == d2, d1 == d3) it is E[d^4]^2 = 64: the loss quadruples, far outside the
    sampling noise of 8192 elements (about 5%)."""

    def __init__(self, p: float = 0.5, layers: int = 4):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.blocks = nn.ModuleList(GainDropoutBlock(p) for _ in range(layers))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return h


def mean_square(out, target):
    return F.mse_loss(out, target)


def two_dropouts(seed: int = 0):
    torch.manual_seed(seed)
    model = TwoDropoutProbe().train()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, 64, HIDDEN, generator=g)
    return workload(model, (x,), torch.zeros(BATCH, 64, HIDDEN), mean_square)


class BatchNormMLP(nn.Module):
    """BatchNorm1d in train mode over all tokens: its statistics span the whole batch."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        B, T = idx.shape
        h = self.fc1(self.emb(idx)).reshape(B * T, -1)
        h = torch.relu(self.bn(h)).reshape(B, T, -1)
        return self.head(self.fc2(h))


def batchnorm(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(BatchNormMLP().train(), (inputs,), target)


FACTORIES = {
    "hw_sum_loss": sum_reduction,
    "hw_label_smoothing": label_smoothing,
    "hw_frozen": frozen_params,
    "hw_inplace_skip": inplace_skip,
    "hw_two_dropouts": two_dropouts,
    "hw_batchnorm": batchnorm,
}


class TPDropoutProbe(nn.Module):
    """Dropout (p=0.8, d in {0, 5}) between a column- and a row-parallel linear, positive
    weights and inputs. z = W2 (d * h) sums 8 masked features, and E[z^2] counts every pair
    of masks: if tp rank 1 drew rank 0's mask for its own features (pairs i, i+4 equal), the
    first loss rises by about a third and the SGD steps then run away: measured over 10 seeds (with the gains),
    independent masks stay within 0.45 (max rel diff over 3 steps) of one process, mirrored
    masks are 10x-20x off."""

    def __init__(self, features: int = 8, width: int = 4, p: float = 0.8):
        super().__init__()
        self.fc1 = nn.Linear(width, features)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(features, width, bias=False)
        with torch.no_grad():
            self.fc1.weight.uniform_(0.5, 1.0)
            self.fc1.bias.zero_()
            self.fc2.weight.fill_(0.05)
        # Two elementwise gains (ones) so that pp=2 with v=2 has a parameter in every chunk.
        self.gain1, self.gain2 = nn.Parameter(torch.ones(width)), nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.fc2(self.drop(self.fc1(x))) * self.gain1 * self.gain2


def tp_dropout(seed: int = 0):
    torch.manual_seed(seed)
    model = TPDropoutProbe().train()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.rand(BATCH, 512, 4, generator=g)
    return workload(model, (x,), torch.zeros(BATCH, 512, 4), mean_square)


FACTORIES["hw_tp_dropout"] = tp_dropout
