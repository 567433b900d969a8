"""More tensor-parallel rules, for projections that reach the rest of the model through
  * complex views: view_as_complex / view_as_real of a column-parallel output (Meta's
    original LLaMA rotary multiplies q and k as complex numbers);
  * repeat: a projection of positions tiled over the batch (DeBERTa-v2's relative-position
    keys and queries, `.repeat(B // H, 1, 1)` against [B*H, T, D] scores);
  * copy_ into a view of a sharded value (RWKV's time-mix writes each step's output into
    `output[:, t]`);
  * torch.gather along a dim that is not sharded (DeBERTa-v2's relative-position scores).
Each keeps the shard where the op treats the sharded dim elementwise and raises NoRule
(the pass then gathers, or keeps the projection whole) where it would not.
"""
from __future__ import annotations

import torch.fx as fx

from threefold.passes.tp_placement import Partial, Replicate, Shard
from threefold.passes.tp_rules import _entering_shards, _fail, _rank, _shard_of


def complex_view(rw, old):
    """view_as_complex eats a last dim of 2, view_as_real adds one: other dims stay put."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    if old.target.__name__.startswith("view_as_complex") and s.dim == _rank(rw.val[x]) - 1:
        _fail(rw, "views the sharded (real, imaginary) pair as complex")
    return rw.copy_node(old, place=s)


def repeat(rw, old):
    """x.repeat(r0, r1, ...): tiles the local shard. Tiling the sharded dim r times makes it
    r blocks of the whole dim (each split alone), the layout of a [B, H/t] -> [B*H/t] view."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    reps = list(old.args[1])
    d = s.dim + len(reps) - _rank(rw.val[x])
    r = reps[d]
    if r == 1:
        return rw.copy_node(old, place=s.moved(d))
    whole = s.blocks or (int(rw.val[x].shape[s.dim]) * rw.t,)
    return rw.copy_node(old, place=Shard(d, tuple(whole) * r, s.seq))


def copy_into(rw, old):
    """dst.copy_(src) with dst sharded: each rank writes its part; src follows dst's layout."""
    dst, src = rw.env[old.args[0]], old.args[1]
    pd = rw.place[dst]
    if not isinstance(pd, Shard):
        _fail(rw, "copies into a value that is not sharded")
    if not isinstance(src, fx.Node):
        return rw.copy_node(old, place=pd)
    new_src = rw.env[src]
    ps = rw.place[new_src]
    k = pd.dim - (_rank(rw.val[dst]) - _rank(rw.val[new_src]))
    if isinstance(ps, Partial) or (isinstance(ps, Replicate) and ps.gathered):
        _fail(rw, f"copies a value placed {ps} into a shard")
    if isinstance(ps, Shard):
        if ps != Shard(k, pd.blocks, pd.seq):
            _fail(rw, f"copies a value sharded {ps} into one sharded {pd}")
    elif k >= 0 and rw.val[new_src].shape[k] != 1:
        new_src = rw.scatter_like(new_src, k, pd)
    else:
        new_src = _entering_shards(rw, new_src)
    rw._note_param_uses(old, sharded=True)
    return rw.emit(old.target, (dst, new_src, *rw._map(old.args[2:])), rw._map(old.kwargs), place=pd,
                   val=rw.val[dst])


def gather_along(rw, old):
    """torch.gather(x, dim, index) along a dim that is not sharded (DeBERTa-v2 picks each
    query's relative-position score): the index is cut like x on the sharded dim."""
    x, index = rw.env[old.args[0]], rw.env[old.args[2]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    dim = old.args[1] % n
    if dim == s.dim or _rank(rw.val[index]) != n:
        _fail(rw, "gathers along the sharded dim")
    pi = rw.place[index]
    if isinstance(pi, Shard):
        if pi != s:
            _fail(rw, f"gathers a value sharded {s} with an index sharded {pi}")
    elif isinstance(pi, Replicate) and not pi.gathered and rw.val[index].shape[s.dim] == rw.val[x].shape[s.dim] * rw.t:
        index = rw.scatter_like(index, s.dim, s)
    else:
        _fail(rw, f"gathers with an index placed {pi} that does not span the sharded dim")
    rw._note_param_uses(old, sharded=True)
    return rw.emit(old.target, (x, old.args[1], index, *rw._map(old.args[3:])), rw._map(old.kwargs), place=s)


SHARE_RULES = {"gather": gather_along, "view_as_complex": complex_view, "view_as_real": complex_view, "repeat": repeat,
               "copy_": copy_into}
