"""Scans along a split sequence (plan `cp=N`): each block's carry comes from the blocks before it.

A cumulative sum, product or log-sum-exp over the sequence is associative, so a sequence cut
into 2cp blocks (rank r holds blocks r and 2cp-1-r, runtime/cp_ops.py) scans exactly as a
chunked scan does on one process: each block scans its own positions, then combines every
position with the carry, the combination of the totals (last scanned values) of all the blocks
before it. The totals, one position per block, are all-gathered; each rank combines those of
the blocks before each of its own. This is the state handed rank to rank of a linear
recurrence (LASP), for the recurrences written as a scan: two positions per rank travel
instead of the whole sequence (the all-gather fallback's cost), and every rank scans only its
own blocks.

Backward is autograd through the combination and through the totals' all-gather, whose
backward sums each rank's gradient of every total over the group (an all-reduce) and keeps
this rank's own.

With group None and ranks > 1 (the memory model running one rank on fake tensors) the local
scan stands in: same shapes, same bytes.
"""
from __future__ import annotations

import torch

from threefold.runtime import comm
from threefold.runtime.cp_ops import _rank, _size

# scan -> (its combine, the carry before the first block, the exclusive scan of the totals)
_KINDS = {
    "cumsum": (torch.add, 0.0),
    "cumprod": (torch.mul, 1.0),
    "logcumsumexp": (torch.logaddexp, float("-inf")),
}
CARRIED = frozenset(_KINDS)


class _GatherTotals(torch.autograd.Function):
    """[2, ...] this rank's two block totals -> [cp, 2, ...] every rank's."""

    @staticmethod
    def forward(ctx, totals, group):
        parts = [torch.empty_like(totals) for _ in range(_size(group))]
        comm.all_gather(parts, totals.contiguous(), group, "scan carries (cp)")
        ctx.group, ctx.r = group, _rank(group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce(g, ctx.group, "scan carry gradients (cp)")
        return g[ctx.r], None


def _scan(kind: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    return getattr(torch, kind)(x, dim)


def _exclusive(kind: str, totals: torch.Tensor) -> torch.Tensor:
    """carry[g] = the combination of totals[0 .. g-1] (blocks in global order along dim 0)."""
    start = torch.full_like(totals[:1], _KINDS[kind][1])
    return torch.cat([start, _scan(kind, totals, 0)[:-1]])


def scan_seq(x: torch.Tensor, dim: int, kind: str, group, ranks: int = 1, dtype=None) -> torch.Tensor:
    """`torch.<kind>(x, dim)` where `dim` is a sequence this rank holds blocks r, 2cp-1-r of."""
    if dtype is not None:
        x = x.to(dtype)
    if group is None:
        return _scan(kind, x, dim)
    cp = _size(group)
    if cp != ranks:
        raise RuntimeError(f"scan_seq was compiled for cp={ranks} but runs on a group of {cp}")
    dim = dim % x.dim()
    b = x.shape[dim] // 2
    mine = [_scan(kind, x.narrow(dim, 0, b), dim), _scan(kind, x.narrow(dim, b, b), dim)]
    totals = torch.stack([m.select(dim, b - 1) for m in mine])            # [2, ...]
    gathered = _GatherTotals.apply(totals, group)                         # [cp, 2, ...]
    # global block g is rank g's first block (g < cp) or rank 2cp-1-g's second one
    order = [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]
    carry = _exclusive(kind, gathered.flatten(0, 1)[order])               # [2cp, ...]
    r, combine = _rank(group), _KINDS[kind][0]
    return torch.cat([combine(m, carry[g].unsqueeze(dim)) for m, g in zip(mine, (r, 2 * cp - 1 - r))], dim)
