"""Sequences shortened inside the model, under cp (plan `cp=N`).

A model that shifts its own tokens for next-token prediction slices the sequence inside
forward: `logits[:, :-1]` beside `labels = x[:, 1:]` (x-transformers' AutoregressiveWrapper),
then a loss over the s - 1 positions left. Traced on this rank's n = s/cp positions, such a
slice drops positions of this rank's blocks, not the sequence's last one; no split of s - 1
positions into 2cp equal blocks exists either.

Exact and without moving the sequence: the shortened value keeps every rank's n positions
(the load-balanced layout of the whole s), and the last k positions of the whole sequence
stand for nothing (its *tail*, recorded in the node's meta as TAIL):

* `x[:, :-k]` (`shorten`) is x itself, with a tail of k;
* `x[:, k:]` is x shifted by k toward the start (cp_shift.shift_seq: the k positions after
  each block fetched from the rank that holds them, a halo exchange), with a tail of k;
* an op that reads a value with a tail (`on_tail`) runs on the n positions (its shape
  arguments carried from the traced n - k, cp_whole.regrow) where the sequence rules place it
  position-wise: positions stay apart, so the tail holds only what stands for nothing; its
  output has the largest tail of its inputs;
* the loss's sum over the sequence reads the positions that exist only (cp_tail.drop_tail
  zeroes the tail first, gradient zero there): each position is counted once.

Refused in one line: anything else that reads a value with a tail (an op that mixes positions,
a mean that would count the tail, a slice of it along the sequence, a model output).
The loss's denominator, where it is computed from the inputs by slicing the sequence (the
count of labels x[:, 1:] that are not ignored), is evaluated on whole sequences
(passes/loss_form.py `whole_along`).
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ops.families import RESHAPES, SLICING, args_of, op_name
from threefold.ops.rules import Gather, Place, Refuse
from threefold.passes.cp_padding import scale_mean
from threefold.passes.cp_rules.core import PARTIAL, Seq, decide
from threefold.passes.cp_whole import is_whole, names_length, remember, twin_named
from threefold.passes.loss_form import final_op
from threefold.runtime import cp_gather, cp_shift, cp_tail
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")
TAIL = "cp_tail"   # meta: positions at the end of the whole sequence that stand for nothing
_END = 2 ** 63 - 1


def tail_of(x) -> int:
    return x.meta.get(TAIL, 0) if isinstance(x, fx.Node) else 0


@dataclass(frozen=True)
class Shorten(Gather):
    """A slice that drops positions at the ends of the split sequence."""


@dataclass(frozen=True)
class OnTail(Gather):
    """An op that reads a value with a tail."""


@dataclass(frozen=True)
class PadShift(Gather):
    """A pad at the end of the split sequence read only from k positions on: a shift."""


def tail_decision(node: fx.Node, state: dict, d):
    """Shorten / OnTail / PadShift for `node` (d: what cp decided for it), else None."""
    if any(tail_of(a) for a in node.all_input_nodes):
        return OnTail("reads a value shortened along the sequence inside the model")
    if (isinstance(d, Gather) or isinstance(d, Refuse) and d.table is None) and _end_pad(node, state) is not None:
        return PadShift(d.why)
    if isinstance(d, Refuse) and d.table is None and op_name(node) == "slice":
        a = args_of(node)
        s, v = state.get(a["self"]), a["self"].meta.get("val")
        if isinstance(s, Seq) and s.inner == 1 and isinstance(v, torch.Tensor) and a["dim"] % v.dim() == s.dim \
                and a["step"] == 1:
            return Shorten(d.why)
    return None


def shorten(node: fx.Node, state: dict, stage, why: str):
    """The slice as this rank's n positions with a tail (module doc): (its state, [])."""
    a = args_of(node)
    src, n, cp = a["self"], stage.seq_len, stage.plan.cp
    d = state[src].dim
    if src.meta["val"].shape[d] != n:
        raise PlanError(why)
    head, drop = _ends(node, a, n, stage, why)
    if head > n // 2 or head + drop >= n * cp:
        raise PlanError(f"{why} (it drops {head} positions at the start: more than a block of {n // 2})")
    traced = node.meta["val"]
    if head:   # x[:, k:]: position i holds x[i + k], the last k of the sequence nothing
        node.target, node.args, node.kwargs = cp_shift.shift_seq, (src, -head, d, CP), {"ranks": cp}
    else:      # x[:, :-k]: x itself, its last k positions nothing
        node.args, node.kwargs = (src, d, 0, _END), {}
    node.meta["val"] = src.meta["val"]
    remember(node, traced)
    node.meta[TAIL] = head + drop
    return Seq(d), []


def _end_pad(node: fx.Node, state: dict):
    """(src, dim, k, value) where node pads the end of the split sequence by k with a number and
    every reader slices it from position k on (`pad(labels, (0, 1), value=-100)[..., 1:]`)."""
    if op_name(node) not in ("pad", "constant_pad_nd"):
        return None
    a = args_of(node)
    src, pad, value = a.get("self", a.get("input")), list(a.get("pad") or []), a.get("value")
    s = state.get(src)
    if not isinstance(s, Seq) or s.inner != 1 or a.get("mode", "constant") != "constant" \
            or not isinstance(value, (int, float)):
        return None
    j = src.meta["val"].dim() - 1 - s.dim   # pad pairs run from the last dim backwards
    if 2 * j + 1 >= len(pad) or pad[2 * j] != 0 or pad[2 * j + 1] <= 0 \
            or any(p for i, p in enumerate(pad) if i // 2 != j):
        return None
    k = pad[2 * j + 1]
    for u in node.users:
        if op_name(u) == "_assert_tensor_metadata":
            continue
        b = args_of(u) if op_name(u) == "slice" else None
        if b is None or b["self"] is not node or b["dim"] % src.meta["val"].dim() != s.dim or b["start"] != k \
                or b["step"] != 1 or not (b["end"] is None or b["end"] >= src.meta["val"].shape[s.dim] + k):
            return None
    return src, s.dim, k, value


def pad_shift(node: fx.Node, state: dict, stage, why: str):
    """pad(x, (0, k), v)[..., k:] -> x shifted by k toward the start, the last k positions of the
    whole sequence v (cp_tail.shift_fill: a halo exchange); its readers' slices keep all of it."""
    src, d, k, value = _end_pad(node, state)
    n, cp = stage.seq_len, stage.plan.cp
    if k > n // 2:
        raise PlanError(f"{why} (it shifts by {k}: more than a block of {n // 2})")
    pad = getattr(stage, "seq_tail", 0)   # an uneven sequence: the fill starts k before its real end
    node.target, node.args, node.kwargs = cp_tail.shift_fill, (src, k, d, value, CP), {
        "ranks": cp, **({"tail": pad} if pad else {})}
    node.meta["val"] = src.meta["val"]
    for u in list(node.users):
        if op_name(u) == "slice":
            u.args, u.kwargs = (node, d, 0, _END), {}
    return Seq(d), []


def _ends(node: fx.Node, a: dict, n: int, stage, why: str) -> tuple:
    """(positions dropped at the start, at the end) of the whole sequence."""
    start, end = a["start"] or 0, a["end"]
    if not isinstance(start, int) or start < 0 or start >= n or not (end is None or isinstance(end, int)):
        raise PlanError(why)
    if end is None or end >= n:
        return start, 0
    if end < 0:
        return start, -end
    twin = twin_named(node, stage)   # a bound traced at the local length: the whole length's twin tells
    whole = n * stage.plan.cp
    t = args_of(twin) if twin is not None and op_name(twin) == "slice" else None
    if t is None or not isinstance(t["end"], int) or whole - t["end"] != n - end or (t["start"] or 0) != start:
        raise PlanError(f"{why} (its bound {end} may be a length: cp cannot tell)")
    return start, n - end


def on_tail(node: fx.Node, state: dict, stage, why: str):
    """Run an op that reads a value with a tail on every local position, where the sequence
    rules place it position-wise (module doc): (its state, [])."""
    n, cp = stage.seq_len, stage.plan.cp
    tails = {tail_of(a) for a in node.all_input_nodes if tail_of(a)}
    tail = max(tails)
    what = f"{why} ({tail} position(s) dropped by a slice: only position-wise ops and the loss's sum may read it)"
    if any(is_whole(a) for a in node.all_input_nodes):
        raise PlanError(what)
    if op_name(node) == "_assert_tensor_metadata" and args_of(node).get("size") is None:
        return None, []   # a dtype check: no value, no shape
    if not isinstance(node.target, torch._ops.OpOverload) and node.target is not operator.getitem:
        raise PlanError(what)   # cp's own ops (ring attention, halos, scans) read other positions
    if op_name(node) in SLICING and "dim" in args_of(node):
        a = args_of(node)
        src = a.get("self", a.get("input"))
        s = state.get(src)
        if isinstance(s, Seq) and a["dim"] is not None and a["dim"] % src.meta["val"].dim() == s.dim:
            raise PlanError(what)
    saved = (node.args, node.kwargs, dict(node.meta))
    traced = node.meta.get("val")
    try:
        if op_name(node) in RESHAPES | {"expand"}:
            _carry_shape(node, n, tails, what, stage)
        elif any(names_length(node, n - t, stage) for t in tails):
            raise PlanError(f"{what} (it names the shortened local length)")
        val = node.target(*fx.node.map_arg(node.args, lambda x: x.meta["val"]),
                          **fx.node.map_arg(node.kwargs, lambda x: x.meta["val"]))
    except PlanError:
        raise
    except Exception as exc:
        node.args, node.kwargs = saved[0], saved[1]
        raise PlanError(f"{what} (and it cannot run on the local positions: {type(exc).__name__})") from None
    remember(node, traced)
    node.meta["val"] = val
    d = decide(node, state, stage)
    if isinstance(d, Place) and d.op is not None and d.op.target is cp_gather.reduce_seq:
        # pooled over the sequence (x[:, 1:].mean(1): the patch tokens without the CLS one):
        # partial sums without the tail, the mean's count the positions that exist
        pad = getattr(stage, "seq_tail", 0)
        node.target, node.args, node.kwargs = d.op.target, d.op.args, {**d.op.kwargs, "tail": tail + pad}
        return d.out, []
    if not isinstance(d, Place) or d.op is not None:
        raise PlanError(what)
    if d.out == PARTIAL:
        return sum_without_tail(node, state, stage, what), []
    outs = d.out if isinstance(d.out, tuple) else (d.out,)
    if not any(isinstance(o, Seq) for o in outs) or not all(isinstance(o, Seq) or o is None for o in outs):
        raise PlanError(what)
    node.meta[TAIL] = tail
    return d.out, []


def _carry_shape(node: fx.Node, n: int, tails: set, what: str, stage) -> None:
    """A view / reshape / expand of a value with a tail: its one size of the shortened length
    (n - k, traced) becomes n (a size -1 is left to be inferred)."""
    names = [arg.name for arg in node.target._schema.arguments]
    key = "size" if "size" in names else "shape"
    size = list(args_of(node)[key])
    at = [j for j, v in enumerate(size) if isinstance(v, int) and v in {n - t for t in tails}]
    if len(at) > 1:   # several sizes of the shortened length (1 beside unit dims): the one the
        twin = twin_named(node, stage)   # model traced at the whole length has longer
        theirs = args_of(twin).get(key) if twin is not None and op_name(twin) == op_name(node) else None
        if isinstance(theirs, (list, tuple)) and len(theirs) == len(size):
            at = [j for j in at if theirs[j] != size[j]]
    if len(at) > 1 or not at and -1 not in size:
        raise PlanError(f"{what} (its {op_name(node)} to {tuple(size)} cannot be carried to the {n} local positions)")
    for j in at:
        size[j] = n
    i = names.index(key)
    if i < len(node.args):
        node.args = node.args[:i] + (size,) + node.args[i + 1:]
    else:
        node.kwargs = {**node.kwargs, key: size}


def sum_without_tail(node: fx.Node, state: dict, stage, what: str):
    """The loss's sum over every position: its input's tail zeroed first (a loss op that sums
    is run per position, then zeroed, then summed). The tail is the shortened one plus the
    padding of an uneven sequence (stage.seq_tail, passes/cp_padding.py)."""
    name, a = op_name(node), args_of(node)
    pad = getattr(stage, "seq_tail", 0)
    form = getattr(stage, "loss_form", None) or {}
    mean = (form.get("denominator") or {}).get("kind") == "const" and form.get("reduction") == "mean" \
        and final_op(node.graph)[0] is node
    if mean and any(tail_of(v) for v in node.all_input_nodes):
        raise PlanError(f"{what} (the loss is a mean over its elements, whose number was traced at this rank's "
                        "shortened length: compute the loss over a sequence shortened outside the model, or use cp=1)")
    if name == "sum":
        x = a.get("self")
        if not isinstance(x, fx.Node) or not isinstance(state.get(x), Seq):
            raise PlanError(what)
        m = _zero_tail(node, x, state[x], tail_of(x) + pad, stage, state)
        node.args = fx.node.map_arg(node.args, lambda v: m if v is x else v)
        if mean:
            scale_mean(node, stage, state)
        return PARTIAL
    aten = isinstance(node.target, torch._ops.OpOverload)
    names = [arg.name for arg in node.target._schema.arguments] if aten else \
        list(inspect.signature(node.target).parameters) if callable(node.target) else []
    # at::Reduction::Sum (loss_form's numerator); a runtime loss (tp's vocab-parallel one) says "sum"
    if "reduction" not in names or a.get("reduction") not in (2, "sum") or not aten and "target" not in a:
        raise PlanError(f"{what} (a {name} would count the dropped positions)")
    graph, i = node.graph, names.index("reduction")
    args, kwargs = list(node.args), dict(node.kwargs)
    each_one = 0 if aten else "none"
    if i < len(args):
        args[i] = each_one
    else:
        kwargs["reduction"] = each_one
    with graph.inserting_before(node):
        each = graph.call_function(node.target, tuple(args), kwargs)
    if aten:
        val = node.target(*fx.node.map_arg(tuple(args), lambda v: v.meta["val"]),
                          **fx.node.map_arg(kwargs, lambda v: v.meta["val"]))
    else:   # a runtime op runs collectives: its per-position terms have the target's shape
        val = torch.zeros(a["target"].meta["val"].shape, dtype=node.meta["val"].dtype)
    each.meta = {"val": val, "tf": dict(tf(node))}
    state[each] = decide(each, state, stage).out
    if not isinstance(state[each], Seq):
        raise PlanError(what)
    tail = max(tail_of(v) for v in node.all_input_nodes) + pad
    m = _zero_tail(node, each, state[each], tail, stage, state)
    node.target, node.args, node.kwargs = torch.ops.aten.sum.default, (m,), {}
    if mean:
        scale_mean(node, stage, state)
    return PARTIAL


def _zero_tail(node: fx.Node, x: fx.Node, s: Seq, tail: int, stage, state: dict) -> fx.Node:
    """cp_tail.drop_tail(x) before node: x's tail zeroed."""
    graph = node.graph
    with graph.inserting_before(node):
        m = graph.call_function(cp_tail.drop_tail, (x, s.dim, tail, stage.seq_len, CP),
                                {"ranks": stage.plan.cp, "inner": s.inner})
    m.meta = {"val": x.meta["val"], "tf": dict(tf(node))}
    state[m] = s
    return m
