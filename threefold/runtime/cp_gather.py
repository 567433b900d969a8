"""The all-gather fallback of context parallelism (plan `cp=N`; passes/cp_fallback.py).

An op that mixes sequence positions and has no ring form (a cumsum over time, a non-causal
convolution, pooling or a reduction over the sequence) runs on the whole sequence: its
inputs are gathered in global order first and, where its output still runs along the
sequence, this rank's blocks are cut out again after it. Every cp rank computes the op on
the same whole value, so the result is exact.

  gather_seq  forward: all-gather, reorder rank-major -> global positions; backward: the
              matching reduce-scatter (each rank's gradient of the whole value is partial:
              it flows only from the positions this rank keeps)
  shard_seq   forward: this rank's blocks r and 2cp-1-r; backward: those rows in a zero
              gradient of the whole value (no communication)

With group None (cp=1, or the memory model running one rank on fakes) and ranks > 1 the
whole value is stood in for by copies of the local one: the shapes, and so the bytes, are
those of a real rank.
"""
from __future__ import annotations

import torch
from threefold.runtime import comm
from threefold.runtime.cp_ops import _rank, _size, block_positions, local_blocks
from threefold.runtime.zero import reduce_scatter_flat


def _rank_major(n: int, cp: int, device) -> torch.Tensor:
    """Global positions in all-gather order: rank 0's n, rank 1's n, ..."""
    return torch.cat([block_positions(n, cp, r, device=device) for r in range(cp)])


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, tail=0):
        cp, n = _size(group), x.shape[dim]
        parts = [torch.empty_like(x.contiguous()) for _ in range(cp)]
        comm.all_gather(parts, x.contiguous(), group, "a sequence shard (cp all-gather fallback)")
        order = torch.argsort(_rank_major(n, cp, x.device))[:n * cp - tail]   # the padding left out
        ctx.dim, ctx.group, ctx.n, ctx.tail = dim, group, n, tail
        return torch.cat(parts, dim=dim).index_select(dim, order)

    @staticmethod
    def backward(ctx, g):
        cp, dim, n = _size(ctx.group), ctx.dim, ctx.n
        if ctx.tail:   # the padding's gradient is zero
            shape = list(g.shape)
            shape[dim] = ctx.tail
            g = torch.cat([g, torch.zeros(shape, dtype=g.dtype, device=g.device)], dim=dim)
        rm = g.index_select(dim, _rank_major(n, cp, g.device)).movedim(dim, 0).contiguous()
        out = torch.empty((n,) + tuple(rm.shape[1:]), dtype=rm.dtype, device=rm.device)
        work = reduce_scatter_flat(out, rm, ctx.group, "a sequence gradient (cp all-gather fallback)")
        comm.wait(work, "a sequence gradient (cp all-gather fallback)", ctx.group)
        return out.movedim(0, dim), None, None, None


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, dim, group):
        cp, r = _size(group), _rank(group)
        ctx.dim, ctx.shape, ctx.cp, ctx.r = dim, y.shape, cp, r
        return local_blocks(y, dim, cp, r).contiguous()   # a length 2cp does not divide: padded first

    @staticmethod
    def backward(ctx, g):
        n = g.shape[ctx.dim]
        shape = list(ctx.shape)
        shape[ctx.dim] = n * ctx.cp
        full = torch.zeros(shape, dtype=g.dtype, device=g.device)
        full.index_copy_(ctx.dim, block_positions(n, ctx.cp, ctx.r, device=g.device), g)
        return full.narrow(ctx.dim, 0, ctx.shape[ctx.dim]), None, None


def gather_seq(x: torch.Tensor, dim: int, group, ranks: int = 1, tail: int = 0) -> torch.Tensor:
    """This rank's blocks of a sequence along `dim` -> the whole sequence, in order; `tail`:
    the positions an uneven sequence was padded by (cp_ops.seq_tail), left out."""
    if group is None:
        return x if ranks == 1 else torch.cat([x] * ranks, dim=dim).narrow(dim, 0, x.shape[dim] * ranks - tail)
    if _size(group) != ranks:
        raise RuntimeError(f"gather_seq was compiled for cp={ranks} but runs on a group of {_size(group)}")
    return _Gather.apply(x, dim, group, tail)


def shard_seq(y: torch.Tensor, dim: int, group, ranks: int = 1) -> torch.Tensor:
    """The whole sequence along `dim` -> this rank's blocks r and 2cp-1-r (a sequence of an
    uneven length padded at its end first, cp_ops.pad_to_blocks)."""
    if group is None:
        return y if ranks == 1 else y.narrow(dim, 0, -(-y.shape[dim] // ranks))
    return _Shard.apply(y, dim, group)
