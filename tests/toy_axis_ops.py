"""The toy axis's runtime op (tests/test_shard_axis.py): how a rank cuts a user input placed
S(d) on it, named by its mesh entry's `cut`."""
from __future__ import annotations

import torch


def rows(t: torch.Tensor, dim: int, size: int, index: int) -> torch.Tensor:
    """Rank `index`'s contiguous share of `size` along `dim`."""
    return t.chunk(size, dim=dim)[index]
