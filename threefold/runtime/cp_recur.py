"""A recurrence over time steps handed rank to rank along a split sequence (plan `cp=N`).

A Python loop over the positions (`for t in range(T): h = f(h, x[:, t])`) is unrolled in the
trace; under cp each rank traces its own two blocks of the sequence (blocks r and 2cp-1-r of
2cp, runtime/cp_ops.py), so each block must start from the state the blocks before it end
with (passes/cp_recurrence.py rewrites the loop around three calls here). In the global
order 0, 1, ..., 2cp-1:

  start  rank r's first block (global block r) starts from the end of block r-1, which is
         rank r-1's first block: received from r-1 (rank 0: the model's own initial state);
  mid    its end goes to rank r+1 (whose first block follows it); rank r's second block
         (2cp-1-r) starts from the end of block 2cp-2-r, rank r+1's second block: received
         from r+1 (rank cp-1's two blocks are consecutive: its own first block's end);
  end    the end of its second block goes to rank r-1 (whose second block follows it).

The blocks therefore run one after the other across the ranks (0, 1, ..., cp-1 for the first
blocks, then cp-1, ..., 0 for the second ones): exact, not overlapped. Each call is an
autograd function whose backward hands the state's gradients the other way (end's backward
receives from r-1, mid's sends to r+1 and receives from it, start's sends to r-1). Every wait
is bounded by the group's timeout (cp_ops._wait). With group None (cp=1, or one rank's view in
the memory model) each call is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.runtime import comm
from threefold.runtime.cp_ops import _rank, _size, _wait


def _post(op, t: torch.Tensor, peer: int, group):
    try:
        return op(t, dist.get_global_rank(group, peer), group=group)
    except Exception as exc:
        raise comm._fail("context parallelism: handing a recurrence's state to", group, exc) from None


def _check(group, ranks: int, name: str) -> None:
    if _size(group) != ranks:
        raise RuntimeError(f"{name} was compiled for cp={ranks} but runs on a group of {_size(group)}")


class _Start(torch.autograd.Function):
    """inits -> the state the rank's first block starts from."""

    @staticmethod
    def forward(ctx, group, anchors, *tensors):
        r, inits = _rank(group), tensors[anchors:]
        ctx.group, ctx.anchors, ctx.shapes = group, anchors, [(t.shape, t.dtype, t.device) for t in inits]
        if r == 0:
            return tuple(t.clone() for t in inits)
        got = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inits]
        _wait([_post(dist.irecv, g, r - 1, group) for g in got], group, "a recurrence's start state")
        return tuple(got)

    @staticmethod
    def backward(ctx, *grads):
        group, r = ctx.group, _rank(ctx.group)
        skip = (None, None) + (None,) * ctx.anchors   # the anchors only carry the backward
        if r == 0:
            return skip + grads
        works = [_post(dist.isend, g.contiguous(), r - 1, group) for g in _filled(list(grads), ctx.shapes)]
        _wait(works, group, "a recurrence's start-state gradients")
        return skip + (None,) * len(grads)


class _Mid(torch.autograd.Function):
    """The first block's end state -> the second block's start state; `hand` says which of
    the states the next rank's first block starts from (what mid sends to r+1)."""

    @staticmethod
    def forward(ctx, group, hand, *states):
        cp, r = _size(group), _rank(group)
        ctx.group, ctx.hand, ctx.shapes = group, hand, [(t.shape, t.dtype, t.device) for t in states]
        if r == cp - 1:
            return tuple(t.clone() for t in states)
        got = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in states]
        works = [_post(dist.isend, states[i].contiguous(), r + 1, group) for i in hand]
        works += [_post(dist.irecv, g, r + 1, group) for g in got]
        _wait(works, group, "a recurrence's state between its blocks")
        return tuple(got)

    @staticmethod
    def backward(ctx, *grads):
        group, hand = ctx.group, ctx.hand
        cp, r = _size(group), _rank(group)
        grads = _filled(list(grads), ctx.shapes)
        if r == cp - 1:
            return (None, None) + tuple(grads)
        back = [torch.empty(ctx.shapes[i][0], dtype=ctx.shapes[i][1], device=ctx.shapes[i][2]) for i in hand]
        works = [_post(dist.isend, g.contiguous(), r + 1, group) for g in grads]
        works += [_post(dist.irecv, g, r + 1, group) for g in back]
        _wait(works, group, "a recurrence's state gradients between its blocks")
        out = [None] * len(grads)
        for i, g in zip(hand, back):
            out[i] = g
        return (None, None) + tuple(out)


class _End(torch.autograd.Function):
    """The second block's end state goes to rank r-1; `y` (a value of the last step) passes
    through, so that the backward runs (it receives the end state's gradients) before the
    second block's."""

    @staticmethod
    def forward(ctx, group, y, *ends):
        r = _rank(group)
        ctx.group, ctx.shapes = group, [(t.shape, t.dtype, t.device) for t in ends]
        if r > 0:
            _wait([_post(dist.isend, t.contiguous(), r - 1, group) for t in ends], group, "a recurrence's end state")
        return y.clone(), y.new_zeros(())

    @staticmethod
    def backward(ctx, gy, _token):
        group, r = ctx.group, _rank(ctx.group)
        if r == 0:
            return (None, gy) + (None,) * len(ctx.shapes)
        got = [torch.empty(s, dtype=d, device=dev) for s, d, dev in ctx.shapes]
        _wait([_post(dist.irecv, g, r - 1, group) for g in got], group, "a recurrence's end-state gradients")
        return (None, gy) + tuple(got)


def _filled(grads: list, shapes: list) -> list:
    """Gradients autograd left None (a state nothing read) as zeros, so every rank sends the same."""
    return [g if g is not None else torch.zeros(s, dtype=d, device=dev) for g, (s, d, dev) in zip(grads, shapes)]


def recur_start(inits: list, anchors: list, group, ranks: int = 1) -> tuple:
    """The states this rank's first block starts from: `inits` (the model's initial state) on
    rank 0, what rank r-1's first block ended with elsewhere. `anchors`, values of the first
    step read from the sequence (and the loop before's recur_end token), make autograd record
    the call, so that its backward runs (their gradients are left untouched)."""
    if group is None:
        return tuple(inits)
    _check(group, ranks, "recur_start")
    return _Start.apply(group, len(anchors), *anchors, *inits)


def recur_mid(states: list, hand: list, group, ranks: int = 1) -> tuple:
    """The states this rank's second block starts from, given its first block's end `states`
    (of which those at `hand` go on to rank r+1's first block)."""
    if group is None:
        return tuple(states)
    _check(group, ranks, "recur_mid")
    return _Mid.apply(group, tuple(hand), *states)


def recur_end(y: torch.Tensor, ends: list, group, ranks: int = 1) -> tuple:
    """(`y` unchanged, a token); this rank's second block's end `ends` go to rank r-1. The next
    loop's recur_start reads the token, so that the backward hands this loop's gradients only
    after the next loop's are handed (the autograd engine would otherwise be free to wait here
    while a neighbour waits in the next loop: a deadlock)."""
    if group is None:
        return y, y.new_zeros(())
    _check(group, ranks, "recur_end")
    return _End.apply(group, y, *ends)
