"""Expert parallelism for experts computed densely (passes/dense_experts.py): every expert
multiplies its own slice of tokens, x[e] of a region input [E, T, in] (Llama 4's experts,
each on a router-scaled copy of every token).

Rank j of the ep group holds experts [j*E/ep, (j+1)*E/ep). For a rank's own tokens:
    1. each region input [E, T, ...] is cut along the experts (on its experts' dim, dim 0 for
       a bmm's [E, T, in], any dim for an einsum's operand) into ep blocks, block j sent
       to rank j (an all-to-all of equal blocks: every rank of the group has T tokens, as dp
       splits the batch evenly); an input without experts that every expert reads whole
       (einsum 'btc,ecf->betf', every expert on every token) goes whole to every rank;
    2. each rank runs the region on each source rank's block separately, with its experts'
       weights: for those slices exactly the ops one process runs (each op of a region keeps
       every expert's slice a function of that slice alone, passes/experts.py checks it);
    3. the results go home by the reverse all-to-all, arriving in expert order, [E, T, ...]:
       the sum over experts (the combine) runs on the tokens' rank as traced.
Both exchanges are `_AllToAll`, whose backward is the reverse exchange: a slice's gradient
returns to its rank and an expert's weight gradient on its rank sums every ep rank's tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.runtime.experts import _AllToAll


def run_dense_experts(fn, num_experts: int, rows: tuple, weights: tuple, others: tuple, group,
                      dims: tuple | None = None) -> tuple:
    """`fn(*rows, *weights, *others)` for this rank's tokens, each expert's slice computed by
    the rank holding it; with no ep group (ep=1) a plain call. `dims` (row dims, output dims):
    the dim of each row input and output that holds the experts (None: dim 0 for all; an
    einsum's experts may sit on another, 'becd,edf->becf'): they are exchanged on dim 0 and
    the region sees and gives them on their own dims; a row dim None is an input every
    expert reads whole (every expert on every token): each rank gets every source's copy."""
    if group is None:
        return fn(*rows, *weights, *others)
    row_dims, out_dims = dims if dims is not None else ((0,) * len(rows), None)
    ep = dist.get_world_size(group)
    local = num_experts // ep
    splits = [local] * ep
    there = [_AllToAll.apply(_to_ranks(x, d, ep), splits if d is not None else [1] * ep,
                             splits if d is not None else [1] * ep, group, "expert tokens")
             for x, d in zip(rows, row_dims)]   # source-major
    per_source = [fn(*(x[s * local:(s + 1) * local].movedim(0, d) if d is not None else x[s]
                       for x, d in zip(there, row_dims)), *weights, *others) for s in range(ep)]
    out_dims = out_dims if out_dims is not None else (0,) * len(per_source[0])
    outs = tuple(torch.cat([o[k].movedim(d, 0) for o in per_source]) for k, d in enumerate(out_dims))
    return tuple(_AllToAll.apply(y, splits, splits, group, "expert outputs").movedim(0, d)
                 for y, d in zip(outs, out_dims))


def _to_ranks(x: torch.Tensor, dim, ep: int) -> torch.Tensor:
    """What goes to the ranks: x with its experts' dim first (cut there into ep blocks), or,
    for an input every expert reads whole (dim None), one copy of x per rank; the copies'
    gradients, back from every rank, sum in the expand's backward."""
    return x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(ep, *x.shape)
