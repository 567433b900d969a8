"""Dimension maps: where a shard goes through a view/reshape/flatten/unflatten.

A reshape pairs runs of input dims with runs of output dims whose sizes multiply to the
same number (tp_placement.reshape_groups). Inside one run, flatten the dims row-major: the
sharded input dim is a factor of `n` elements at stride `inner` (the product of the run's
dims after it), repeated `outer` times (the dims before it, times the pieces of a
block-strided dim). Every rank holds one contiguous 1/t of that factor. In the output
run, the factor's top part lies inside one output dim j; sharding that part t ways is the
same layout, so dim j is sharded — plainly when nothing in dim j sits above the factor,
block-strided (blocks of equal size) when something does: [batch, heads/t] merged into
[batch*heads] holds heads/t of each batch row's heads (blocks (heads,)*batch).
"""
from __future__ import annotations

import math

from threefold.errors import PlanError
from threefold.passes.tp_placement import Shard, reshape_groups


def reshape_placement(src: list[int], src_local: list[int], dst: list[int], s: Shard, t: int):
    """(the output's Shard, the output's local sizes) for a reshape src -> dst of a value
    sharded `s`; PlanError when the layout cannot be followed."""
    d = s.dim
    for gi, gj in reshape_groups(src, dst):
        if d in gi:
            break
    else:
        raise PlanError(f"dim {d} has no counterpart")
    if not gj:
        raise PlanError("the sharded dim is reshaped away")
    if s.blocks and len(set(s.blocks)) > 1:
        if len(gi) == 1 and len(gj) == 1:   # unequal pieces ([q|k|v]) only pass through unchanged
            out = list(dst)
            out[gj[0]] = src_local[d]
            return Shard(gj[0], s.blocks, s.seq), out
        raise PlanError(f"a dim of unequal pieces {list(s.blocks)} is reshaped")
    n = s.blocks[0] if s.blocks else src[d]
    inner = math.prod(src[i] for i in gi if i > d)
    top = inner * n
    for j in gj:
        after = math.prod(dst[k] for k in gj if k > j)
        if after < top <= after * dst[j]:
            break
    else:
        raise PlanError("no output dim holds the shard")
    low = max(inner, after)
    if low % after or top % low or (after * dst[j]) % top:
        raise PlanError("the shard straddles output dims")
    m, inner_j, outer_j = top // low, low // after, (after * dst[j]) // top
    if m % t:
        raise PlanError(f"size {m} is not divisible by tp={t}")
    out = list(dst)
    out[j] = dst[j] // t
    blocks = (m * inner_j,) * outer_j if outer_j > 1 else ()
    return Shard(j, blocks, s.seq), out


def padded_reshape(src: list[int], src_local: list[int], dst: list[int], s: Shard, t: int):
    """reshape_placement for a padded shard: the reshape as the padded model would do it
    ([.., 32] -> [.., 4, 8] for 3 heads of 8 padded to 4), the padding landing on one whole
    output dim; PlanError where no output dim can take it whole."""
    d = s.dim
    src_p = list(src)
    src_p[d] = src_local[d] * t
    for gi, gj in reshape_groups(src, dst):
        if d in gi:
            break
    else:
        raise PlanError(f"dim {d} has no counterpart")
    total, total_p = math.prod(src[i] for i in gi), math.prod(src_p[i] for i in gi)
    for j in gj:
        if (dst[j] * total_p) % total:
            continue
        dst_p = list(dst)
        dst_p[j] = dst[j] * total_p // total
        try:
            place, local = reshape_placement(src_p, src_local, dst_p, s, t)
        except PlanError:
            continue
        if place.dim == j and not place.blocks:
            return place, local
    raise PlanError(f"the padding of dim {d} does not fall on one whole output dim")
