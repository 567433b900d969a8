"""SPEC factories for the training-loop tests: workloads with their own data sources."""
from __future__ import annotations

import torch

from threefold.models.gpt import GPT, GPTConfig, lm_loss

VOCAB = 32
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,;:\n"   # 32 characters: one id each


class Chars:
    """A character tokenizer over ALPHABET (unknown characters become spaces)."""

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) if c in ALPHABET else ALPHABET.index(" ") for c in text]

    def decode(self, ids) -> str:
        return "".join(ALPHABET[int(i)] for i in ids)


def model(seq: int = 8) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=2, n_head=2, n_embd=16))


def batch_at(step: int, batch: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A different random batch for every step (seeded by the step: the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def stepped(batch: int = 4, seq: int = 8):
    """batches(step), fixed validation batches and a tokenizer: --batch/--seq apply."""
    return {"model": model(seq), "loss_fn": lm_loss, "batches": lambda step: batch_at(step, batch, seq),
            "val_batches": [batch_at(-1 - i, batch, seq) for i in range(2)], "tokenizer": Chars()}


def listed():
    """Three batches in a list: an iterable that starts over when it ends."""
    return {"model": model(), "loss_fn": lm_loss, "batches": [batch_at(i) for i in range(3)]}


def one_shot():
    """A generator of three batches: read once, in order."""
    return {"model": model(), "loss_fn": lm_loss, "batches": (batch_at(i) for i in range(3))}


def fixed():
    """One fixed batch and no batch/seq parameters: --batch/--seq mean nothing here."""
    x, y = batch_at(0)
    return {"model": model(), "inputs": (x,), "target": y, "loss_fn": lm_loss}
