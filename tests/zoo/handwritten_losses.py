"""Losses written the ways users write them: class scores on dim 1, a hand-written weighted
token mean, and a loss that does not separate over batch rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.zoo.common import token_batch, workload
from tests.zoo.handwritten_attention import NanoGPTAttention, TinyDecoder


def _decoder(seed: int):
    torch.manual_seed(seed)
    return TinyDecoder(NanoGPTAttention).train()


def class_dim1_loss(logits, target):
    # [B, T, V] -> [B, V, T]: cross_entropy's class dimension is dim 1, not the last one.
    return F.cross_entropy(logits.permute(0, 2, 1), target)


def class_dim1(seed: int = 0):
    inputs, target = token_batch(seed=seed)
    return workload(_decoder(seed), (inputs,), target, class_dim1_loss)


def weighted_token_loss(logits, target):
    # Per-token weights derived from the target (weights 1..4 by token id), normalised by
    # their global sum: a masked mean written by hand, not via ignore_index.
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
    w = (target.reshape(-1) % 4 + 1).to(ce.dtype)
    return (ce * w).sum() / w.sum()


def weighted_tokens(seed: int = 0):
    inputs, target = token_batch(seed=seed)
    return workload(_decoder(seed), (inputs,), target, weighted_token_loss)


def squared_mean_loss(logits, target):
    # (mean CE)^2 does not separate over rows: no combination of per-microbatch parts is exact.
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)) ** 2


def nonseparable(seed: int = 0):
    inputs, target = token_batch(seed=seed)
    return workload(_decoder(seed), (inputs,), target, squared_mean_loss)


FACTORIES = {
    "hw_ce_class_dim1": class_dim1,
    "hw_weighted_tokens": weighted_tokens,
    "hw_nonseparable_loss": nonseparable,
}
