"""Placements for tensor parallelism and the shape algebra the TP pass needs.

A value is Replicate (every tp rank holds all of it), Partial (every rank holds a summand)
or Shard(dim, blocks): dim is split over the tp ranks. `blocks` describes a dim that is a
concatenation of pieces (a fused QKV projection's output is [q | k | v]); each piece is
split separately, so after `split` every rank holds its own slice of q, of k and of v.
Local sizes are computed exactly with sympy rationals; a size that does not divide is a
PlanError naming the node, the size and t.
"""
from __future__ import annotations

import math

import torch

import sympy

from threefold.errors import PlanError
# The placement types live in threefold/placement.py (the runtime reads them too).
from threefold.placement import P, R, Partial, Replicate, Shard  # noqa: F401


def local_size(global_size: int, t: int, what: str) -> int:
    """global_size / t as an exact integer, or a PlanError."""
    q = sympy.Rational(global_size, t)
    if not q.is_integer:
        raise PlanError(f"{what}: size {global_size} is not divisible by tp={t}; "
                        f"choose tp dividing {global_size}")
    return int(q)


def scaled_size(size: int, local: int, global_: int, what: str, t: int) -> int:
    """size * local / global exactly (how a sharded factor carries through a reshape)."""
    q = sympy.Rational(size * local, global_)
    if not q.is_integer or q <= 0:
        raise PlanError(f"{what}: size {size} cannot be split over tp={t} "
                        f"(it would hold {q} per rank); choose tp dividing {size}")
    return int(q)


def reshape_groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims whose products match: [B,T,C] -> [B,T,H,D] gives
    ([0],[0]), ([1],[1]), ([2],[2,3])."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + (i < len(src)), j + (j < len(dst))
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def padded(size: int, t: int) -> int:
    return int(math.ceil(size / t) * t)


def to_meta(v):
    """A value's shape, strides and dtype on the meta device (lists and tuples elementwise)."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(to_meta(x) for x in v)
    return v
