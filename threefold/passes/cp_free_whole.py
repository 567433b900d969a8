"""Input-free values along the sequence computed whole on every cp rank (plan `cp=N`).

Under cp a value made from constants, buffers, parameters and `arange` over the sequence (no
user input: `input_free`) holds this rank's positions: `arange(n)` became cp_ops.positions,
a table sliced to the sequence reads this rank's rows (passes/context_parallel.py). That is
right for position-wise work, but an op that reads such a value at fixed positions or along
the sequence (HF's packed-sequence check `position_ids[:, :1]` then `diff` and `cumsum` over
them, a `max` of the positions) would read this rank's blocks, not the sequence.

Such a value costs no communication to compute whole: every rank can compute what one
process computes. Where cp would gather or refuse an op and every split input of it is
input-free (`free_whole_decision`), those inputs are rebuilt at the whole length
(`whole_of`: positions -> arange(s), a factory cut by shard_seq -> the whole factory, every
op between them rerun on the whole fakes with its shape arguments carried over, cp_whole.py)
and the op runs on them whole. Its output is then a value computed whole (cp_whole.WHOLE
where a dim grew; not along the sequence where the op reduced or sliced it away), which the
walker places by the usual rules: an op that meets it and a split value gathers (cp_whole_inputs),
and an input-free split value that meets a whole one is itself made whole (`free_inputs_whole`)
instead of gathered. Exact: every rank computes one process's value; nothing is moved.
Where the whole form cannot be built (a shape argument cp cannot carry to the whole length),
the op's own decision stands (the all-gather fallback, or its refusal).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ops.families import op_name
from threefold.ops.rules import Gather, Place, Refuse
from threefold.passes.cp_masks import input_free
from threefold.passes.cp_rules import decide
from threefold.passes.cp_rules.core import Seq
from threefold.passes.cp_whole import TWIN, is_whole, mark, remember, run_whole, twin_named, whole_length
from threefold.runtime import cp_gather, cp_ops
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


@dataclass(frozen=True)
class FreeWhole(Gather):
    """Run the op on whole forms of its input-free split inputs; `then` is the decision cp
    had for it (taken where the whole form cannot be built)."""
    then: object = None


def free_whole_decision(node: fx.Node, state: dict, d):
    """FreeWhole(d) where cp gathers or refuses `node` (a refusal that names no table to
    rewrite) and every input of it along the sequence is input-free; else None."""
    if not (isinstance(d, Gather) or isinstance(d, Refuse) and d.table is None):
        return None
    ins = [a for a in node.all_input_nodes if state.get(a) is not None]
    if not ins or not all(isinstance(state[a], Seq) and input_free(a) for a in ins):
        return None
    return FreeWhole(d.why, d)


def run_free_whole(node: fx.Node, state: dict, stage, cache: dict, why: str):
    """Rebuild node's split inputs whole and run it on them: (its state, [] moved), or a
    PlanError (the graph left as it was)."""
    saved = (node.args, node.kwargs, dict(node.meta))
    made: list = []
    try:
        wholes = {a: whole_of(a, state, stage, cache, node, made) for a in node.all_input_nodes
                  if isinstance(state.get(a), Seq)}
        node.args = fx.node.map_arg(node.args, lambda a: wholes.get(a, a))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a: wholes.get(a, a))
        run_whole(node, stage.seq_len, why, stage)
    except PlanError:
        node.args, node.kwargs = saved[0], saved[1]
        node.meta.clear()
        node.meta.update(saved[2])
        _forget(made, cache, state)
        raise
    return None, []


def free_inputs_whole(node: fx.Node, state: dict, stage, cache: dict) -> None:
    """An op that reads a value computed whole: its input-free split inputs made whole too
    (no all-gather for them); where one cannot be, it stays split (and is gathered)."""
    for a in list(node.all_input_nodes):
        if not isinstance(state.get(a), Seq) or not input_free(a):
            continue
        made: list = []
        try:
            w = whole_of(a, state, stage, cache, node, made)
        except PlanError:
            _forget(made, cache, state)
            continue
        node.args = fx.node.map_arg(node.args, lambda x: w if x is a else x)
        node.kwargs = fx.node.map_arg(node.kwargs, lambda x: w if x is a else x)


def whole_of(x: fx.Node, state: dict, stage, cache: dict, before: fx.Node, made: list) -> fx.Node:
    """The node computing x (an input-free value split along the sequence) over the whole
    sequence, in global order; built before `before` (new nodes appended to `made`)."""
    if x in cache:
        return cache[x]
    if not isinstance(state.get(x), Seq):
        return x   # not along the sequence (constants, parameters) or already whole
    if x.op != "call_function":
        raise PlanError(f"{x.name} is split along the sequence but no call")
    graph, n, cp = x.graph, stage.seq_len, stage.plan.cp
    if x.target is cp_gather.shard_seq:   # this rank's blocks of a whole value: the value itself
        new = _real_part(x, before, made, stage)
    elif x.target is cp_ops.positions:     # this rank's global positions: all of them
        length = _arange_length(x, stage)
        kwargs = {k: v for k, v in x.kwargs.items() if k in ("dtype", "device")}
        with graph.inserting_before(before):
            new = graph.call_function(torch.ops.aten.arange.default, (length,), kwargs)
        new.meta = {"val": torch.arange(length, dtype=kwargs.get("dtype") or torch.int64,
                                        device=x.meta["val"].device), "tf": dict(tf(x))}
        made.append(new)
        remember(new, x.meta["val"])
        mark(new, x.meta["val"], new.meta["val"])
    else:
        args = {a: whole_of(a, state, stage, cache, before, made) for a in x.all_input_nodes}
        with graph.inserting_before(before):
            new = graph.node_copy(x, lambda a: args.get(a, a))
        new.meta = {"val": x.meta.get("val"), "tf": dict(tf(x)), TWIN: x.meta.get(TWIN, x.name)}
        made.append(new)
        run_whole(new, n, f"{x.name} computed whole", stage)
    state[new] = None
    cache[x] = new
    return new


def _arange_length(x: fx.Node, stage) -> int:
    """The whole length of the arange that positions `x` stands for: s, unless the model traced
    at the whole length keeps it at n (HF's arange(batch) where the batch equals s/cp: a
    coincidence of sizes, not the sequence; then arange(n) is its whole form)."""
    n = stage.seq_len
    twin = twin_named(x, stage)
    val = twin.meta.get("val") if twin is not None and op_name(twin) == "arange" else None
    if isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == n:
        return n
    return whole_length(stage)


def _real_part(x: fx.Node, before: fx.Node, made: list, stage) -> fx.Node:
    """The whole value shard_seq `x` cuts, without a padded sequence's padding (a factory made at
    the padded length S' and cut at once, cp_factories.py): its first S positions."""
    y, d = x.args[0], x.args[1]
    v, s = y.meta.get("val"), whole_length(stage)
    if not isinstance(v, torch.Tensor) or v.shape[d] == s:
        return y
    with x.graph.inserting_before(before):
        new = x.graph.call_function(torch.ops.aten.narrow.default, (y, d, 0, s))
    new.meta = {"val": v.narrow(d, 0, s), "tf": dict(tf(y))}
    made.append(new)
    remember(new, x.meta["val"])
    mark(new, x.meta["val"], new.meta["val"])
    return new


def _forget(made: list, cache: dict, state: dict) -> None:
    """Erase the whole forms built by a failed attempt (last first; none is read yet)."""
    for k in [k for k, v in cache.items() if v in made]:
        del cache[k]
    for m in reversed(made):
        state.pop(m, None)
        if not m.users:
            m.graph.erase_node(m)


def cut_whole_inputs(node: fx.Node, state: dict, stage):
    """An op that meets a value computed whole (one dim of the whole length s where it was
    traced at n: positions in global order) and a split one: cut the whole value to this rank's
    blocks (cp_gather.shard_seq, a local slice: nothing moved) where the sequence rules then
    place the op position-wise; its Place, or None (the graph left as it was: gather)."""
    n, cp = stage.seq_len, stage.plan.cp
    if not any(isinstance(state.get(a), Seq) for a in node.all_input_nodes):
        return None
    cuts = {}
    for a in node.all_input_nodes:
        if not is_whole(a):
            continue
        v, old = a.meta.get("val"), a.meta.get("cp_traced_shape")
        if not isinstance(v, torch.Tensor) or old is None or len(old) != v.dim():
            return None
        grown = [d for d in range(v.dim()) if v.shape[d] != old[d]]
        if len(grown) != 1 or old[grown[0]] != n or v.shape[grown[0]] != whole_length(stage):
            return None
        cuts[a] = grown[0]
    graph, made = node.graph, {}
    for a, d in cuts.items():
        with graph.inserting_before(node):
            c = graph.call_function(cp_gather.shard_seq, (a, d, CP), {"ranks": cp})
        c.meta = {"val": a.meta["val"].narrow(d, 0, n), "tf": dict(tf(a))}
        state[c] = Seq(d)
        made[a] = c
    saved = (node.args, node.kwargs)
    node.args = fx.node.map_arg(node.args, lambda x: made.get(x, x))
    node.kwargs = fx.node.map_arg(node.kwargs, lambda x: made.get(x, x))
    d = decide(node, state, stage)
    if isinstance(d, Place) and d.op is None:
        return d.out
    node.args, node.kwargs = saved
    for c in made.values():
        state.pop(c, None)
        graph.erase_node(c)
    return None
