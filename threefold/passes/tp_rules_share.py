"""More tensor-parallel rules, for projections that reach the rest of the model through
  * complex views: view_as_complex / view_as_real of a column-parallel output (Meta's
    original LLaMA rotary multiplies q and k as complex numbers);
  * repeat: a projection of positions tiled over the batch (DeBERTa-v2's relative-position
    keys and queries, `.repeat(B // H, 1, 1)` against [B*H, T, D] scores);
  * copy_ into a view of a sharded value (RWKV's time-mix writes each step's output into
    `output[:, t]`);
  * torch.gather along a dim that is not sharded (DeBERTa-v2's relative-position scores).
Each keeps the shard where the op treats the sharded dim elementwise and refuses (the pass
then gathers, or keeps the projection whole) where it would not. Pure rules on
tp_decisions.REGISTRY (see tp_rules.py).
"""
from __future__ import annotations

import torch.fx as fx

from threefold.ops.rules import Op
from threefold.passes.tp_decisions import REGISTRY, TpCall, TpDecision, refuse
from threefold.passes.tp_placement import Partial, Replicate, Shard
from threefold.passes.tp_redistribute import ENTER, Cut


@REGISTRY.rule("view_as_complex", "view_as_real")
def complex_view(c: TpCall) -> TpDecision:
    """view_as_complex eats a last dim of 2, view_as_real adds one: other dims stay put."""
    s = c.shard(c.x)
    if c.name == "view_as_complex" and s.dim == c.rank(c.x) - 1:
        refuse("views the sharded (real, imaginary) pair as complex")
    return TpDecision(s)


@REGISTRY.rule("repeat")
def repeat(c: TpCall) -> TpDecision:
    """x.repeat(r0, r1, ...): tiles the local shard. Tiling the sharded dim r times makes it
    r blocks of the whole dim (each split alone), the layout of a [B, H/t] -> [B*H/t] view."""
    x = c.x
    s = c.shard(x)
    reps = list(c.args["repeats"])
    d = s.dim + len(reps) - c.rank(x)
    r = reps[d]
    if r == 1:
        return TpDecision(s.moved(d))
    whole = s.blocks or (int(c.local(x).shape[s.dim]) * c.t,)
    return TpDecision(Shard(d, tuple(whole) * r, s.seq))


@REGISTRY.rule("copy_")
def copy_into(c: TpCall) -> TpDecision:
    """dst.copy_(src) with dst sharded: each rank writes its part; src follows dst's layout."""
    dst, src = c.args["self"], c.args["src"]
    pd = c.place(dst)
    if not isinstance(pd, Shard):
        refuse("copies into a value that is not sharded")
    op = Op(c.node.target, c.node.args, c.node.kwargs, val=c.local(dst))
    if not isinstance(src, fx.Node):
        return TpDecision(pd)
    ps = c.place(src)
    k = pd.dim - (c.rank(dst) - c.rank(src))
    if isinstance(ps, Partial) or (isinstance(ps, Replicate) and ps.gathered):
        refuse(f"copies a value placed {ps} into a shard")
    if isinstance(ps, Shard):
        if ps != Shard(k, pd.blocks, pd.seq):
            refuse(f"copies a value sharded {ps} into one sharded {pd}")
        need = None
    elif k >= 0 and c.local(src).shape[k] != 1:
        need = Cut(k, pd)
    else:
        need = ENTER
    return TpDecision(pd, {src: need} if need else {}, op, uses="sharded")


@REGISTRY.rule("gather")
def gather_along(c: TpCall) -> TpDecision:
    """torch.gather(x, dim, index) along a dim that is not sharded (DeBERTa-v2 picks each
    query's relative-position score): the index is cut like x on the sharded dim."""
    x, index = c.args["self"], c.args["index"]
    s = c.shard(x)
    n = c.rank(x)
    if c.args["dim"] % n == s.dim or c.rank(index) != n:
        refuse("gathers along the sharded dim")
    pi = c.place(index)
    need = None
    if isinstance(pi, Shard):
        if pi != s:
            refuse(f"gathers a value sharded {s} with an index sharded {pi}")
    elif isinstance(pi, Replicate) and not pi.gathered and c.local(index).shape[s.dim] == c.local(x).shape[s.dim] * c.t:
        need = Cut(s.dim, s)
    else:
        refuse(f"gathers with an index placed {pi} that does not span the sharded dim")
    return TpDecision(s, {index: need} if need else {}, uses="sharded")
