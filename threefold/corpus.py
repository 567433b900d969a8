"""The embedded character corpus the main job trains on (threefold/data/corpus.txt)."""
from __future__ import annotations

import os

import torch

PATH = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")


class CharCorpus:
    """Character-level tokens of a text; batches are random windows, seeded per step."""

    def __init__(self, path: str = PATH):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch: int, seq: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (batch, seq); identical on every rank for a given step."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq - 1, (batch,), generator=g)
        window = torch.stack([self.tokens[s:s + seq + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)
