"""Shared pieces of the zoo's workloads: a logits-only wrapper, token batches, LM losses."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Tiny sizes every family uses unless the case needs otherwise.
VOCAB, SEQ, BATCH, HIDDEN, LAYERS = 96, 8, 4, 32, 2


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def masked_lm_loss(logits, target):
    # ignore_index=-100 is cross_entropy's default; spelled out because it is the point.
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100)


class LogitsOnly(torch.nn.Module):
    """Returns the logits tensor instead of a ModelOutput, so the loss can follow."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def token_batch(vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ, seed: int = 0):
    """Next-token inputs and targets, [batch, seq] each, from a seeded generator."""
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def workload(model, inputs, target, loss_fn=lm_loss):
    return {"model": model, "inputs": tuple(inputs), "target": target, "loss_fn": loss_fn}
