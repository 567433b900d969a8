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
from threefold.runtime.cp_ops import _rank, _size, block_positions, local_blocks, pad_to_blocks
from threefold.runtime.cp_tail import drop_tail
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
    if group is None:   # a stand-in of this rank's share: as long as one (an uneven sequence padded first)
        return y if ranks == 1 else pad_to_blocks(y, dim, ranks).narrow(dim, 0, -(-y.shape[dim] // (2 * ranks)) * 2)
    return _Shard.apply(y, dim, group)


class _Select(torch.autograd.Function):
    """One global position of the sequence, the same on every cp rank: the rank that holds it
    contributes it, the others zeros, summed (all-reduce); backward: the gradients of the cp
    ranks' copies summed, at that position on its holder (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, x, dim, index, group):
        cp, n = _size(group), x.shape[dim]
        hit = (block_positions(n, cp, _rank(group), device=x.device) == index % (n * cp)).nonzero()
        ctx.dim, ctx.group, ctx.shape = dim, group, x.shape
        ctx.local = int(hit[0, 0]) if len(hit) else None
        y = x.select(dim, ctx.local).clone() if ctx.local is not None else \
            x.new_zeros(x.shape[:dim] + x.shape[dim + 1:])
        comm.all_reduce(y, group, "one position read along the sequence (cp select)")
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce(g, ctx.group, "the gradient of one position read along the sequence (cp select)")
        full = g.new_zeros(ctx.shape)
        if ctx.local is not None:
            full.select(ctx.dim, ctx.local).copy_(g)
        return full, None, None, None


def select_seq(x: torch.Tensor, dim: int, index: int, group, ranks: int = 1) -> torch.Tensor:
    """x.select(dim, index) at a global position `index` of a sequence split along `dim` (a
    CLS token read as x[:, 0]): the same value on every cp rank."""
    if group is None:   # one rank standing in for a real one (fakes): its shapes
        return x.select(dim, index % x.shape[dim])
    return _Select.apply(x, dim, index, group)


class _Sum(torch.autograd.Function):
    """A sum over dims that include the split sequence, the same on every cp rank: each rank's
    sum of its positions, all-reduced; backward: the cp ranks' gradients of it summed,
    broadcast back over this rank's positions."""

    @staticmethod
    def forward(ctx, x, dims, keepdim, group):
        y = x.sum(dim=dims, keepdim=keepdim).contiguous()
        comm.all_reduce(y, group, "a sum over the sequence (cp)")
        ctx.dims, ctx.keepdim, ctx.group, ctx.shape = dims, keepdim, group, x.shape
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce(g, ctx.group, "the gradient of a sum over the sequence (cp)")
        if not ctx.keepdim:
            for d in sorted(d % len(ctx.shape) for d in ctx.dims):
                g = g.unsqueeze(d)
        return g.expand(ctx.shape), None, None, None


def reduce_seq(x: torch.Tensor, dims: list, keepdim: bool, mean: bool, group, ranks: int = 1, tail: int = 0,
               seq: int | None = None) -> torch.Tensor:
    """x.sum / x.mean over `dims`, one of them the sequence split along the cp group (a
    mean-pooled ViT): a partial sum per rank, all-reduced (B x C moved, not the sequence).
    `tail`: the padding of a sequence 2cp does not divide (along dim `seq`), left out of the
    sum and of the mean's count."""
    cp = ranks if group is None else _size(group)
    if tail:
        x = drop_tail(x, seq, tail, x.shape[seq], group, cp)
    count = cp   # one of dims is the sequence: every rank's positions count, the padding does not
    for d in dims:
        count *= x.shape[d]
    if tail:
        count = count // (cp * x.shape[seq]) * (cp * x.shape[seq] - tail)
    y = x.sum(dim=dims, keepdim=keepdim) if group is None else _Sum.apply(x, list(dims), keepdim, group)
    return y / count if mean else y
