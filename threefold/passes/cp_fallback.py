"""The all-gather fallback for ops that mix sequence positions under cp (runtime/cp_gather.py).

passes/context_parallel.py calls `gather_around` where a sequence rule decides Gather (the
families cp_rules.GATHERABLE: reductions, softmaxes, scans, sorts, convolutions, pools and
contractions over the sequence). It rewrites op(x) into shard_seq(op(gather_seq(x))): every sequence-split input is
gathered whole (global order), the op runs as one process runs it, and an output that still
runs along the sequence (the dim of the whole length s, where the traced one had s/cp) is
cut back to this rank's blocks; an output without one (a reduction over the sequence) stays
whole on every rank. The op is exact; the cost is one all-gather forward and one
reduce-scatter backward per input, recorded in `fallbacks` (inspect lists them with bytes).
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
from threefold.runtime import cp_gather
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


def gather_around(node: fx.Node, state: dict, stage, why: str, fallbacks: list, name: str, seq_cls):
    """Rewrite `node` to run on gathered inputs; returns its output's placement (None: whole),
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
            any(not isinstance(state[a], seq_cls) for a in ins) or _names_length(node, n):
        raise PlanError(why) from None
    if any(state[a].inner != 1 or a.meta["val"].shape[state[a].dim] != n for a in ins):
        raise PlanError(f"{why} (its sequence is merged with another dim there, so it cannot be gathered)") from None
    graph, cp = node.graph, plan.cp
    whole = {}
    for a in ins:
        d = state[a].dim
        with graph.inserting_before(node):
            g = graph.call_function(cp_gather.gather_seq, (a, d, CP), {"ranks": cp})
        val = a.meta["val"]
        g.meta = {"val": torch.cat([val] * cp, dim=d), "tf": dict(tf(node))}
        state[g] = None
        whole[a] = g
        fallbacks.append({"op": name, "node": node.name, "module": tf(node).get("module") or "<top>",
                          "elements": val.numel(), "bytes": (cp - 1) * val.numel() * val.element_size()})
    node.args = fx.node.map_arg(node.args, lambda a: whole.get(a, a))
    node.kwargs = fx.node.map_arg(node.kwargs, lambda a: whole.get(a, a))
    try:
        full = node.target(*fx.node.map_arg(node.args, lambda a: a.meta["val"]),
                           **fx.node.map_arg(node.kwargs, lambda a: a.meta["val"]))
    except Exception as exc:
        raise PlanError(f"{why} (and it cannot run on the gathered sequence: {type(exc).__name__})") from None
    fulls = list(full) if isinstance(full, (tuple, list)) else [full]
    cuts = [_seq_dim(o, f, cp, why) for o, f in zip(outs, fulls)]
    node.meta["val"] = full
    if not isinstance(out, (tuple, list)):
        if cuts[0] is not None:
            _cut(node, cuts[0], out, cp)
        return None   # the op itself is whole; shard_seq's rule gives Seq(d) when the loop reaches it
    for u in list(node.users):   # several outputs: each getitem that still runs along the sequence is cut
        if u.target is operator.getitem and cuts[u.args[1]] is not None:
            u.meta["val"] = fulls[u.args[1]]
            _cut(u, cuts[u.args[1]], outs[u.args[1]], cp)
    return tuple(None for _ in outs)


def _seq_dim(out, full, cp: int, why: str):
    """The dim of the whole output that runs along the sequence (None: none does)."""
    dims = [d for d in range(out.dim()) if full.shape[d] != out.shape[d]]
    if not dims:
        return None
    if len(dims) != 1 or full.shape[dims[0]] != out.shape[dims[0]] * cp:
        raise PlanError(f"{why} (its output {tuple(out.shape)} does not run along the sequence)")
    return dims[0]


def _cut(node: fx.Node, d: int, local, cp: int) -> None:
    """shard_seq after `node`: this rank's blocks of its whole value, for every later user."""
    graph = node.graph
    with graph.inserting_after(node):
        cut = graph.call_function(cp_gather.shard_seq, (node, d, CP), {"ranks": cp})
    cut.meta = {"val": local, "tf": dict(tf(node))}
    node.replace_all_uses_with(cut, delete_user_cb=lambda u: u is not cut)


def _names_length(node: fx.Node, n: int) -> bool:
    """An integer argument equal to the local length (besides dims): it would be wrong on the whole."""
    found = []

    def look(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                look(x)
        elif isinstance(a, int) and not isinstance(a, bool) and a == n:
            found.append(a)
    look(list(node.args[1:]))
    look(list(node.kwargs.values()))
    return bool(found)
