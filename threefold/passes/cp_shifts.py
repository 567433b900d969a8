"""Token shifts along the split sequence, found by data flow (plan `cp=N`).

A value T of the sequence's length n whose position i holds x[i-k] (zero where i-k falls
outside the sequence), built from a sequence-split x by any chain of slices along the
sequence, constant zero pads (negative pads crop: `ZeroPad2d((0, 0, 1, -1))`), and
concatenations with zeros (`cat([zeros, x[:, :-1]], 1)`, `F.pad(x[:, :-1], (0, 0, 1, 0))`), is
a shift by k: the chain is replaced by runtime/cp_shift.shift_seq, which fetches the |k|
positions each block reads from the neighbouring block's rank (a halo exchange). Found where
one of the chain's ops would be gathered or refused (passes/context_parallel.py asks
`shift_halo`); the chain's other values must not be read elsewhere (else no rewrite).

Each value of the chain is described by `Shifted`: along the sequence dim it has `length`
positions, position i holds src[i-k] for lo <= i < hi and zero elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.ops.families import CASTS, CONSTANT_LIKE, COPIES, UNIFORM_FACTORIES, args_of, family, op_name
from threefold.passes.cp_rules.core import Seq
from threefold.runtime import cp_shift, cp_tail
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")
_SAME = COPIES - CASTS - {"detach"}   # the same values, gradients kept (a detach would stop them)


def _in_chain(x: fx.Node) -> bool:
    """An op a shift's chain may hold: slices, pads, joins, copies, factories of zeros."""
    return x.op == "call_function" and (family(x) in ("slicing", "pad", "join") or op_name(x) in _SAME or _zero(x))


_DEPTH = 8


@dataclass(frozen=True)
class Shifted:
    src: object        # the sequence-split value read (fx.Node), None: all zeros
    k: int
    lo: int
    hi: int
    length: int


def shift_halo(node: fx.Node, state: dict, stage) -> bool:
    """If `node` (an op cp would gather or refuse) is part of a token shift of a
    sequence-split value, replace the shift by cp_shift.shift_seq and erase its chain
    (`node` included); True where it did."""
    found = _shift_through(node, state, stage)
    if found is None:
        return False
    end, form, d = found
    graph = node.graph
    with graph.inserting_before(end):
        new = graph.call_function(cp_shift.shift_seq, (form.src, form.k, d, CP), {"ranks": stage.plan.cp})
    new.meta = {"val": end.meta["val"], "tf": dict(tf(end))}
    pad = getattr(stage, "seq_tail", 0)
    if pad and form.k < 0:   # a look-ahead near the end of an uneven sequence reads its padding, where one
        with graph.inserting_after(new):   # process reads zeros: zeroed (and the padding itself, nothing)
            ahead = graph.call_function(cp_tail.drop_tail, (new, d, pad - form.k, stage.seq_len, CP),
                                        {"ranks": stage.plan.cp})
        ahead.meta = dict(new.meta)
        end.replace_all_uses_with(ahead)
        state[ahead] = Seq(d)
    else:
        end.replace_all_uses_with(new)
    state[new] = Seq(d)   # placed here: inserted before the node check_sequence is at, the loop would not reach it
    for x in _dead_after(end, form.src):
        state.pop(x, None)
        graph.erase_node(x)
    return True


def _shift_through(node: fx.Node, state: dict, stage):
    """(the chain's last value, its Shifted, the sequence dim) of a whole shift that `node`
    takes part in and that leaves `node` unread, or None."""
    n = stage.seq_len
    frontier, seen = [node], set()
    for _ in range(_DEPTH):
        nxt = []
        for x in frontier:
            if x in seen:
                continue
            seen.add(x)
            for d in _seq_dims(x, state):
                f = _form(x, d, state, _DEPTH)
                if f is not None and f.src is not None and f.length == n and f.k != 0 \
                        and f.src.meta["val"].shape[d] == n \
                        and (f.lo, f.hi) == (max(f.k, 0), min(n, n + f.k)) and abs(f.k) <= n // 2 \
                        and node in _dead_after(x, f.src):
                    return x, f, d
            nxt += [u for u in x.users if _in_chain(u)]
        frontier = nxt
    return None


def _seq_dims(x: fx.Node, state: dict) -> list:
    """The dims a chain value could shift along: those of the sequence-split values it reads."""
    v = x.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return []
    dims, stack, seen = set(), [x], set()
    while stack and len(seen) < 64:
        y = stack.pop()
        if y in seen:
            continue
        seen.add(y)
        s = state.get(y)
        if isinstance(s, Seq) and s.inner == 1 and y.meta["val"].dim() == v.dim():
            dims.add(s.dim)
        elif _in_chain(y):
            stack.extend(y.all_input_nodes)
    return sorted(dims)


def _form(x, d: int, state: dict, depth: int):
    """x as a Shifted along dim d, or None where it is not one."""
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dim() <= d or depth == 0:
        return None
    s, name = state.get(x), op_name(x)
    if isinstance(s, Seq) and s.dim == d and s.inner == 1:
        return Shifted(x, 0, 0, v.shape[d], v.shape[d])
    if _zero(x):
        return Shifted(None, 0, 0, 0, v.shape[d])
    if not _in_chain(x):
        return None
    a = args_of(x)
    if name in _SAME:
        src = a.get("self", a.get("input"))
        return _form(src, d, state, depth - 1) if src.meta["val"].dtype == v.dtype else None
    if name == "slice":
        f = _form(a["self"], d, state, depth - 1)
        if f is None or a["dim"] % v.dim() != d or a["step"] != 1:
            return None
        start, end, _ = slice(a["start"], a["end"]).indices(f.length)
        return _moved(f, -start, max(end - start, 0))
    if name in ("constant_pad_nd", "pad"):
        if name == "pad" and (a.get("mode", "constant") != "constant"):
            return None
        pad, value = list(a["pad"]), a.get("value")
        j = v.dim() - 1 - d
        if value not in (None, 0, 0.0) or any(p for i, p in enumerate(pad) if i // 2 != j) or 2 * j + 1 >= len(pad):
            return None
        f = _form(a["self"], d, state, depth - 1)
        return None if f is None else _moved(f, pad[2 * j], f.length + pad[2 * j] + pad[2 * j + 1])
    if name == "cat":
        if a["dim"] % v.dim() != d:
            return None
        offset, live = 0, []
        for t in a["tensors"]:
            f = _form(t, d, state, depth - 1)
            if f is None:
                return None
            if f.src is not None:
                live.append(_moved(f, offset, v.shape[d]))
            offset += f.length
        return _joined(live, v.shape[d])
    return None


def _moved(f: Shifted, by: int, length: int) -> Shifted:
    """f with its positions moved by `by` and cut to [0, length)."""
    lo, hi = min(max(f.lo + by, 0), length), min(max(f.hi + by, 0), length)
    return Shifted(f.src, f.k + by, lo, hi, length) if hi > lo else Shifted(None, 0, 0, 0, length)


def _joined(parts: list, length: int):
    """Concatenated pieces of one shift: the same source and k, ranges end to start."""
    if not parts:
        return Shifted(None, 0, 0, 0, length)
    parts = sorted(parts, key=lambda f: f.lo)
    if any(p.src is not parts[0].src or p.k != parts[0].k for p in parts) \
            or any(a.hi != b.lo for a, b in zip(parts, parts[1:])):
        return None
    return Shifted(parts[0].src, parts[0].k, parts[0].lo, parts[-1].hi, length)


def _zero(x) -> bool:
    """A value that is all zeros whatever it reads (zeros, zeros_like, full(.., 0), their views)."""
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    name = op_name(x)
    if name in UNIFORM_FACTORIES | CONSTANT_LIKE:
        fill = args_of(x).get("fill_value")
        return name.endswith("zeros") or name == "zeros_like" or (fill is not None and fill == 0)
    if family(x) in ("view", "dim_move") or name in _SAME:
        return _zero(x.args[0])
    return False


def _dead_after(end: fx.Node, src: fx.Node) -> list:
    """The values nothing reads once `end` is replaced by a shift of `src`, in an order that
    erases readers first (`end` first)."""
    near, frontier = set(), [end]
    for _ in range(_DEPTH + 2):   # the chain and what its zero factories read
        frontier = [y for x in frontier for y in x.all_input_nodes if y is not src and y not in near]
        near.update(frontier)
    dead, order, changed = {end}, [end], True
    while changed:
        changed = False
        for x in sorted(near, key=lambda y: y.name):
            if x in dead or x.op != "call_function" or x.is_impure():
                continue
            asserts = [u for u in x.users if u not in dead]   # may only be metadata asserts, erased with it
            if all(op_name(u) == "_assert_tensor_metadata" and not u.users for u in asserts):
                dead.update(asserts + [x])
                order.extend(asserts + [x])
                changed = True
    return order
