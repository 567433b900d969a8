"""Expert parallelism for experts computed densely (passes/dense_experts.py): every expert
multiplies its own slice of tokens, x[e] of a region input [E, T, in] (Llama 4's experts,
each on a router-scaled copy of every token).

Rank j of the ep group holds experts [j*E/ep, (j+1)*E/ep). For a rank's own tokens:
    1. each region input [E, T, ...] is cut along the experts into ep blocks, block j sent
       to rank j (an all-to-all of equal blocks: every rank of the group has T tokens, as dp
       splits the batch evenly);
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


def run_dense_experts(fn, num_experts: int, rows: tuple, weights: tuple, others: tuple, group) -> tuple:
    """`fn(*rows, *weights, *others)` for this rank's tokens, each expert's slice computed by
    the rank holding it; with no ep group (ep=1) a plain call."""
    if group is None:
        return fn(*rows, *weights, *others)
    ep = dist.get_world_size(group)
    local = num_experts // ep
    splits = [local] * ep
    there = [_AllToAll.apply(x, splits, splits, group, "expert tokens") for x in rows]   # source-major
    per_source = [fn(*(x[s * local:(s + 1) * local] for x in there), *weights, *others) for s in range(ep)]
    outs = tuple(torch.cat([o[k] for o in per_source]) for k in range(len(per_source[0])))
    return tuple(_AllToAll.apply(y, splits, splits, group, "expert outputs") for y in outs)
