"""The all-gather fallback for ops that mix sequence positions under cp (runtime/cp_gather.py).

cp's redistribution on the sharding walker (passes/shard.py, passes/context_parallel.py) calls
`gather_around` where a sequence rule decides Gather (the
families cp_rules.GATHERABLE: reductions, softmaxes, scans, sorts, convolutions, pools and
contractions over the sequence). It rewrites op(x) into shard_seq(op(gather_seq(x))): every sequence-split input is
gathered whole (global order), the op runs as one process runs it, and an output that still
runs along the sequence (the dim of the whole length s, where the traced one had s/cp) is
cut back to this rank's blocks; an output without one (a reduction over the sequence) stays
whole on every rank. The op is exact; the cost is one all-gather forward and one
reduce-scatter backward per input, returned for the walker's fallback record (inspect lists
them with bytes).
`strict=true` makes it the PlanError it was. Refused still: an op whose arguments name the
local length (a slice or view to s/cp would be wrong on the whole), and an output of
another length. Ops with several outputs (sort, topk, cummax) have each output that runs
along the sequence cut back after its getitem; topk's indices are global positions, as in
one process.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.errors import PlanError
from threefold.ops.families import RESHAPES, family, op_name
from threefold.passes.cp_counts import mark_counts
from threefold.passes.cp_whole import is_whole, mark, names_length, one_mode, regrow, remember, twin_named
from threefold.runtime import cp_gather
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


def gather_around(node: fx.Node, state: dict, stage, why: str, name: str, seq_cls):
    """Rewrite `node` to run on gathered inputs; returns its output's placement (None: whole)
    and the bytes each gathered input moves per occurrence (the walker records the fallback),
    or raises the one-line PlanError `why` where the fallback cannot apply."""
    plan, n = stage.plan, stage.seq_len
    where = f"{name} at {tf(node).get('module') or '<top>'}"
    if plan.strict:
        raise PlanError(f"cp={plan.cp}: strict plan: {where} mixes sequence positions; drop strict=true to let "
                        "threefold all-gather the sequence around it, or use cp=1")
    out = node.meta.get("val")
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    ins = [a for a in node.all_input_nodes if state.get(a) is not None]
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs) or \
            any(not isinstance(state[a], seq_cls) for a in ins) or \
            (names_length(node, n, stage) and not any(is_whole(a) for a in node.all_input_nodes)
             and op_name(node) not in RESHAPES | {"expand"}):
        raise PlanError(why) from None
    merged = {a: _digits(a.meta["val"].shape, state[a], n) for a in ins
              if state[a].inner != 1 or a.meta["val"].shape[state[a].dim] != n}
    if merged and not _keeps_layout(outs, merged, n):
        raise PlanError(f"{why} (its sequence is merged with another dim there, so it cannot be gathered)") from None
    tail = getattr(stage, "seq_tail", 0)   # an uneven sequence's padding: gathered without it (cp_padding.py)
    counts = bool(merged) and family(node) in ("scan", "sort")
    if counts and (tail or twin_named(node, stage) is None):
        # a running count over the tokens of the whole batch (an expert capacity queue): exact when
        # gathered, and the numbers the model compares it with (capacity = factor * tokens / experts,
        # a constant computed from the traced token count) are read from the model traced at the whole
        # length (passes/cp_counts.py); without that trace they would be this rank's: 1.5e-3 off
        how = (f"on a sequence padded to {2 * plan.cp} blocks the model traced at the whole length counts the "
               f"padding too: use a sequence length that is a multiple of {2 * plan.cp}") if tail else \
            "the model does not trace at the whole length to give one process's"
        raise PlanError(f"{why} (a scan or sort over the tokens of the whole batch, such as an expert capacity "
                        "queue, is compared with numbers the model computes from the token count, constants of the "
                        f"trace that are this rank's count under cp; {how})") from None
    graph, cp = node.graph, plan.cp
    whole, moved = {}, []
    for a in ins:
        d = state[a].dim
        g = _gather(graph, node, a, d, merged.get(a), cp, tail)
        state[g] = None
        whole[a] = g
        val = a.meta["val"]
        moved.append((cp - 1) * val.numel() * val.element_size())
    node.args = fx.node.map_arg(node.args, lambda a: whole.get(a, a))
    node.kwargs = fx.node.map_arg(node.kwargs, lambda a: whole.get(a, a))
    for a, g in whole.items():
        remember(g, a.meta["val"])
    regrow(node, n, why, stage)   # a view / expand of the whole value: its shape argument carried over
    val = one_mode(node)
    try:
        full = node.target(*fx.node.map_arg(node.args, val), **fx.node.map_arg(node.kwargs, val))
    except Exception as exc:
        raise PlanError(f"{why} (and it cannot run on the gathered sequence: {type(exc).__name__})") from None
    fulls = list(full) if isinstance(full, (tuple, list)) else [full]
    grid = not isinstance(out, (tuple, list)) and not merged and _grid(out, full, cp, tail)
    layout = next(iter(merged.values()), None)   # outputs of a merged op keep its input's digits
    short = tail * (layout[0] * layout[1] if layout else 1)   # the padding's elements along a merged dim
    cuts = [None] if grid else [_seq_dim(o, f, cp, why, short) for o, f in zip(outs, fulls)]
    node.meta["val"] = full
    if counts:   # everything computed from it reads one process's numbers (cp_counts.py)
        mark_counts(node)
    if grid:   # it runs along the sequence twice (positions paired with positions): kept whole
        remember(node, out)
        mark(node, out, full)
        return None, moved
    if not isinstance(out, (tuple, list)):
        if cuts[0] is not None:
            _cut(node, cuts[0], out, cp, layout)
        return None, moved   # the op itself is whole; shard_seq's rule gives Seq(d) when the loop reaches it
    for u in list(node.users):   # several outputs: each getitem that still runs along the sequence is cut
        if u.target is operator.getitem and cuts[u.args[1]] is not None:
            u.meta["val"] = fulls[u.args[1]]
            _cut(u, cuts[u.args[1]], outs[u.args[1]], cp, layout)
    return tuple(None for _ in outs), moved


def _digits(shape, s, n: int):
    """A dim that merges the sequence with others ([b*s*k] after a flatten): (outer, inner)."""
    return shape[s.dim] // (n * s.inner), s.inner


def _keeps_layout(outs: list, merged: dict, n: int) -> bool:
    """Every output has the merged input's shape, or no dim of its merged size (a reduction):
    then an output that runs along the sequence has the input's digits."""
    layouts = set(merged.values())
    shapes = {tuple(a.meta["val"].shape) for a in merged}
    sizes = {a.meta["val"].shape[d] for a in merged for d in range(a.meta["val"].dim())
             if a.meta["val"].shape[d] % n == 0 and a.meta["val"].shape[d] != n}
    return len(layouts) == 1 and all(tuple(o.shape) in shapes or not set(o.shape) & sizes for o in outs)


def _split_digits(graph, x: fx.Node, d: int, layout, val, length: int):
    """view(x): dim d as [outer, length, inner]."""
    outer, inner = layout
    shape = list(val.shape[:d]) + [outer, length, inner] + list(val.shape[d + 1:])
    v = graph.call_function(torch.ops.aten.reshape.default, (x, shape))
    v.meta = {"val": val.reshape(shape), "tf": dict(tf(x))}
    return v


def _gather(graph, node: fx.Node, a: fx.Node, d: int, layout, cp: int, tail: int = 0) -> fx.Node:
    """gather_seq of `a` along d (through its digits where the sequence is merged there), the
    `tail` positions of an uneven sequence's padding left out."""
    val = a.meta["val"]
    with graph.inserting_before(node):
        if layout is None:
            g = graph.call_function(cp_gather.gather_seq, (a, d, CP), {"ranks": cp, **({"tail": tail} if tail else {})})
            g.meta = {"val": torch.cat([val] * cp, dim=d).narrow(d, 0, val.shape[d] * cp - tail), "tf": dict(tf(node))}
            return g
        n = val.shape[d] // (layout[0] * layout[1])
        v = _split_digits(graph, a, d, layout, val, n)
        g = graph.call_function(cp_gather.gather_seq, (v, d + 1, CP), {"ranks": cp, **({"tail": tail} if tail else {})})
        g.meta = {"val": torch.cat([v.meta["val"]] * cp, dim=d + 1).narrow(d + 1, 0, n * cp - tail),
                  "tf": dict(tf(node))}
        shape = list(val.shape[:d]) + [layout[0] * (n * cp - tail) * layout[1]] + list(val.shape[d + 1:])
        r = graph.call_function(torch.ops.aten.reshape.default, (g, shape))
        r.meta = {"val": g.meta["val"].reshape(shape), "tf": dict(tf(node))}
        return r


def _grid(out, full, cp: int, tail: int = 0) -> bool:
    """Two or more dims of the whole output run along the sequence (cp_whole.py keeps it whole)."""
    dims = [d for d in range(out.dim()) if full.shape[d] != out.shape[d]]
    return len(dims) > 1 and all(full.shape[d] == out.shape[d] * cp - tail for d in dims)


def _seq_dim(out, full, cp: int, why: str, tail: int = 0):
    """The dim of the whole output that runs along the sequence (None: none does); `tail`: the
    whole sequence is shorter than the traced one by an uneven length's padding."""
    dims = [d for d in range(out.dim()) if full.shape[d] != out.shape[d]]
    if not dims:
        return None
    if len(dims) != 1 or full.shape[dims[0]] != out.shape[dims[0]] * cp - tail:
        raise PlanError(f"{why} (its output {tuple(out.shape)} does not run along the sequence)")
    return dims[0]


def _cut(node: fx.Node, d: int, local, cp: int, layout=None) -> None:
    """shard_seq after `node`: this rank's blocks of its whole value, for every later user
    (through its digits where the sequence is merged there: the result is laid out as before)."""
    graph = node.graph
    if layout is None:
        with graph.inserting_after(node):
            cut = graph.call_function(cp_gather.shard_seq, (node, d, CP), {"ranks": cp})
        cut.meta = {"val": local, "tf": dict(tf(node))}
        node.replace_all_uses_with(cut, delete_user_cb=lambda u: u is not cut)
        return
    full = node.meta["val"]
    with graph.inserting_after(node):
        v = _split_digits(graph, node, d, layout, full, full.shape[d] // (layout[0] * layout[1]))
    with graph.inserting_after(v):
        cut = graph.call_function(cp_gather.shard_seq, (v, d + 1, CP), {"ranks": cp})
    # this rank's n of the whole (an uneven one padded to 2cp blocks first: ceil)
    cut.meta = {"val": local.reshape(v.meta["val"].shape[:d + 1] + (-1,) + v.meta["val"].shape[d + 2:]),
                "tf": dict(tf(node))}
    with graph.inserting_after(cut):
        back = graph.call_function(torch.ops.aten.reshape.default, (cut, list(local.shape)))
    back.meta = {"val": local, "tf": dict(tf(node))}
    node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not v)
