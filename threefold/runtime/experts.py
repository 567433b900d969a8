"""Expert parallelism at run time: each token-expert row goes to the rank holding its expert
and comes back, with all-to-all over the ep group (plan `ep=N`; passes/experts.py finds the
expert regions, codegen writes each as a method `_experts_k`).

A region's rows arrive sorted by expert, with `offs` the cumulative row count per expert
(what grouped matmuls take). Rank j of the ep group holds experts [j*E/ep, (j+1)*E/ep), so
the rows for rank j are one contiguous block: no sort is needed to dispatch.

    1. counts per expert are exchanged first (an all-to-all of E/ep integers per peer), so
       every rank knows how many rows it receives from each peer for each local expert;
    2. the rows move (all_to_all_single with uneven splits), arriving grouped by source
       and, within a source, by expert; a permutation groups them by local expert;
    3. the region's method runs on the local rows with the local experts' weights and the
       local offsets, exactly as one process runs it on those rows (every op in a region is
       row-wise: passes/experts.py checks it);
    4. the inverse permutation and the reverse all-to-all send each result row home.

`_AllToAll` is an autograd.Function whose backward is the reverse all-to-all, so gradients
of the rows flow back to the ranks they came from, and the expert weights' gradients on
their holder sum the contributions of every ep rank's tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.runtime import comm


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split `in_splits` to the group's ranks; `out_splits` rows from each back."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, what):
        ctx.splits, ctx.group, ctx.what = (out_splits, in_splits), group, what
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group, what)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, ctx.group, ctx.what + " gradients")
        return back, None, None, None, None


def run_experts(fn, num_experts: int, offs: torch.Tensor, rows: tuple, weights: tuple, others: tuple,
                group) -> tuple:
    """`fn(offs, *rows, *weights, *others)` for this rank's tokens, computed by the ranks
    holding their experts. `weights` are this rank's E/ep experts; with no ep group (ep=1)
    it is a plain call."""
    if group is None:
        return fn(offs, *rows, *weights, *others)
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    local = num_experts // ep
    if offs.is_meta:   # a dry run (runtime/dry_run.py): no data to route, so routing is balanced
        return _balanced(fn, offs, rows, weights, others, group, ep, me, local)
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    total = int(offs[-1]) if len(offs) else 0
    n_rows = rows[0].shape[0] if rows else 0
    if total > n_rows:
        raise RuntimeError(f"expert region: offsets cover {total} rows but only {n_rows} arrived")
    if total < n_rows:   # dropped rows (capacity, Hugging Face's EP sentinel) sort past the last expert
        kept = run_experts(fn, num_experts, offs, tuple(x[:total] for x in rows), weights, others, group)
        return tuple(torch.cat([k, d]) for k, d in zip(kept, _past_last_expert(fn, offs[:local], rows, total,
                                                                               weights, others)))
    send = counts.view(ep, local).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, [1] * ep, [1] * ep, group, "tokens per expert")
    send_splits = send.sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    perm = _by_expert(recv)
    local_offs = torch.cumsum(recv.sum(0), 0).to(offs.dtype)
    there = [_AllToAll.apply(x, recv_splits, send_splits, group, "expert tokens")[perm] for x in rows]
    outs = fn(local_offs, *there, *weights, *others)
    inverse = torch.argsort(perm)
    return tuple(_AllToAll.apply(y[inverse], send_splits, recv_splits, group, "expert outputs") for y in outs)


def _balanced(fn, offs, rows: tuple, weights: tuple, others: tuple, group, ep: int, me: int, local: int) -> tuple:
    """The exchange of `run_experts` when every rank routes its rows evenly over the ep
    ranks (the first n % ep ranks take one more): the same collectives, with the splits
    balanced routing gives, on tensors without data."""
    n = rows[0].shape[0] if rows else 0
    send_splits = [n // ep + (1 if j < n % ep else 0) for j in range(ep)]
    recv_splits = [send_splits[me]] * ep      # every rank holds n rows (its even share of the batch)
    counts = offs.new_empty((ep, local), dtype=torch.int64)
    comm.all_to_all(torch.empty_like(counts), counts, [1] * ep, [1] * ep, group, "tokens per expert")
    there = [_AllToAll.apply(x, recv_splits, send_splits, group, "expert tokens") for x in rows]
    outs = fn(offs.new_empty((local,)), *there, *weights, *others)
    return tuple(_AllToAll.apply(y, send_splits, recv_splits, group, "expert outputs") for y in outs)


def _past_last_expert(fn, offs, rows: tuple, total: int, weights: tuple, others: tuple) -> tuple:
    """The region's outputs for rows past the last expert's offset, on the token's own rank:
    the method run on those rows alone with this rank's experts and every offset 0 (`offs`
    is E/ep long), so every row is past the last expert, as in one process. Exact when the
    grouped op gives such rows a value that does not depend on the weights (zeros: grouped
    matmuls give no expert's product to a row no expert owns)."""
    none = torch.zeros_like(offs)
    return fn(none, *(x[total:] for x in rows), *weights, *others)


def _by_expert(recv: torch.Tensor) -> torch.Tensor:
    """The order that groups received rows by local expert (then by source rank): rows
    arrive as source 0's experts 0..n-1, source 1's experts 0..n-1, ..."""
    sizes = recv.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    ep, local = recv.shape
    pieces = [torch.arange(int(starts[j * local + i]), int(starts[j * local + i] + sizes[j * local + i]))
              for i in range(local) for j in range(ep)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def keep_local_experts(module, ep_rank: int, ep: int) -> None:
    """Replace each expert parameter (module.EXPERTS: FQN -> number of experts, dim 0) of a
    loaded chunk module by this ep rank's E/ep experts: a new Parameter, so the optimizer
    holds and updates only those."""
    for fqn, experts in module.EXPERTS.items():
        full = module.p(fqn)
        n = experts // ep
        piece = full.detach()[ep_rank * n:(ep_rank + 1) * n].clone()
        module._owner(fqn).register_parameter(fqn.rsplit(".", 1)[-1],
                                              torch.nn.Parameter(piece, requires_grad=full.requires_grad))
    module._state_cache = None
