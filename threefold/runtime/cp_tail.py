"""Positions a sequence shortened inside the model does not have (plan `cp=N`;
passes/cp_tails.py): `x[:, :-k]` or `x[:, k:]` of a split sequence keeps every rank's n
positions, the last k of the whole sequence standing for nothing. A sum over the sequence
reads only the others."""
from __future__ import annotations

import torch

from threefold.runtime.cp_ops import _rank, _size, block_positions
from threefold.runtime.cp_shift import shift_seq


def drop_tail(x: torch.Tensor, dim: int, tail: int, n: int, group, ranks: int = 1, inner: int = 1) -> torch.Tensor:
    """x with the positions at or after s - tail (s: the whole length) zeroed, gradient zero
    there too. Along `dim` x holds [outer, n, inner] (the sequence merged with its neighbours
    after a flatten: outer rows of n positions of inner elements each)."""
    cp = _size(group) if group is not None else ranks
    dim = dim % x.dim()
    pos = block_positions(n, cp, _rank(group), device=x.device)
    keep = (pos < n * cp - tail)[None, :, None].expand(x.shape[dim] // (n * inner), n, inner).reshape(-1)
    keep = keep.reshape([x.shape[dim] if d == dim else 1 for d in range(x.dim())])
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def shift_fill(x: torch.Tensor, k: int, dim: int, value, group, ranks: int = 1, tail: int = 0) -> torch.Tensor:
    """x shifted toward the start by k along the split sequence, the last k positions of the
    whole sequence `value`: `pad(x, (0, k), value=v)[..., k:]` (Hugging Face's shift of the
    labels, -100 padded) on this rank's blocks. `tail`: the padding of an uneven sequence
    (cp_ops.seq_tail): the fill starts k positions before the real end, and covers the padding."""
    y = shift_seq(x, -k, dim, group, ranks)
    dim = dim % x.dim()
    n = x.shape[dim]
    cp = _size(group) if group is not None else ranks
    pos = block_positions(n, cp, _rank(group), device=x.device)
    keep = (pos < n * cp - tail - k).reshape([n if d == dim else 1 for d in range(x.dim())])
    return torch.where(keep, y, torch.full((), value, dtype=x.dtype, device=x.device))
