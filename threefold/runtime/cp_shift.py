"""A token shift along a split sequence (plan `cp=N`): out[..., i, ...] = x[..., i-k, ...], zero
where i-k falls outside the sequence (RWKV's time shift, `cat([zeros, x[:, :-1]])`, a pad that
crops; passes/cp_shifts.py recognises them).

Under cp the sequence is cut into 2N blocks and rank r holds blocks r and 2N-1-r
(runtime/cp_ops.py). Shifting a block by k > 0 needs the last k positions of the block before
it; by k < 0, the first -k of the block after it: a halo, fetched by p2p from the rank that
holds that block (the rank itself where both blocks are its own), zeros at the sequence's
ends. The backward sends each halo's gradient back to the rank it came from.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from threefold.runtime import comm
from threefold.runtime.cp_ops import _wait


def _owner(block: int, cp: int) -> tuple[int, int]:
    """(cp rank, slot 0 or 1) that holds global block `block` of 2cp."""
    return (block, 0) if block < cp else (2 * cp - 1 - block, 1)


def _pieces(x: torch.Tensor, k: int, dim: int) -> list[torch.Tensor]:
    """Per slot, the positions the neighbouring block reads: its last k (k > 0) or first -k."""
    b = x.shape[dim] // 2
    return [x.narrow(dim, s * b + b - k, k) if k > 0 else x.narrow(dim, s * b, -k) for s in (0, 1)]


def _plan(cp: int, r: int, k: int):
    """For each slot: (source rank, source slot) of the halo it reads, or None (zeros); and
    for each slot: the rank that reads its piece, or None."""
    step = 1 if k > 0 else -1
    blocks = (r, 2 * cp - 1 - r)
    reads = [_owner(g - step, cp) if 0 <= g - step < 2 * cp else None for g in blocks]
    readers = [_owner(g + step, cp)[0] if 0 <= g + step < 2 * cp else None for g in blocks]
    return reads, readers


class _Halos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, dim, group):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        reads, readers = _plan(cp, r, k)
        mine = [p.contiguous() for p in _pieces(x, k, dim)]
        halos, works = [], []
        for s, src in enumerate(reads):
            if src is None:
                halos.append(torch.zeros_like(mine[s]))
            elif src[0] == r:
                halos.append(mine[src[1]].clone())
            else:
                buf = torch.empty_like(mine[s])
                works.append(_post(dist.irecv, buf, src[0], group))
                halos.append(buf)
        for s, dst in enumerate(readers):
            if dst is not None and dst != r:
                works.append(_post(dist.isend, mine[s], dst, group))
        _wait(works, group, "token-shift halos")
        ctx.k, ctx.dim, ctx.group, ctx.shape = k, dim, group, x.shape
        return tuple(halos)

    @staticmethod
    def backward(ctx, g0, g1):
        group, k, dim = ctx.group, ctx.k, ctx.dim
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        reads, readers = _plan(cp, r, k)
        grads = [g.contiguous() for g in (g0, g1)]
        dx = torch.zeros(ctx.shape, dtype=g0.dtype, device=g0.device)
        at = _pieces(dx, k, dim)
        works, back = [], []
        for s, src in enumerate(reads):   # a halo's gradient goes back where the halo came from
            if src is not None and src[0] == r:
                at[src[1]].add_(grads[s])
            elif src is not None:
                works.append(_post(dist.isend, grads[s], src[0], group))
        for s, dst in enumerate(readers):
            if dst is not None and dst != r:
                buf = torch.empty_like(at[s])
                works.append(_post(dist.irecv, buf, dst, group))
                back.append((s, buf))
        _wait(works, group, "token-shift halo gradients")
        for s, buf in back:
            at[s].add_(buf)
        return dx, None, None, None


def _post(op, t: torch.Tensor, peer: int, group):
    try:
        return op(t, dist.get_global_rank(group, peer), group=group)
    except Exception as exc:
        raise comm._fail("context parallelism: exchanging token-shift halos with", group, exc) from None


def shift_seq(x: torch.Tensor, k: int, dim: int, group, ranks: int = 1) -> torch.Tensor:
    """x shifted by k along the sequence dim `dim`: out[i] = x[i-k], zeros where i-k is
    outside the sequence, with x this rank's two blocks (blocks r and 2cp-1-r). `ranks` is
    the cp size the code was compiled for; group None: the whole sequence (cp=1, or one rank's
    view in the memory model)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if group is None:
        return _shift_whole(x, k, dim)
    if dist.get_world_size(group) != ranks:
        raise RuntimeError(f"shift_seq was compiled for cp={ranks} but runs on a group of "
                           f"{dist.get_world_size(group)}")
    b = n // 2
    if abs(k) > b:
        raise RuntimeError(f"shift_seq: a shift by {k} reaches past a block of {b} positions")
    h0, h1 = _Halos.apply(x, k, dim, group)
    blocks = []
    for h, s in ((h0, 0), (h1, 1)):
        block = x.narrow(dim, s * b, b)
        kept = block.narrow(dim, 0, b - k) if k > 0 else block.narrow(dim, -k, b + k)
        blocks.append(torch.cat([h, kept] if k > 0 else [kept, h], dim))
    return torch.cat(blocks, dim)


def _shift_whole(x: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    pad = [0, 0] * (x.dim() - 1 - dim) + [k, -k]   # pad k before, crop k after (or the reverse)
    return F.pad(x, pad)
