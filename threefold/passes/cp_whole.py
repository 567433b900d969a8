"""Values over a grid of positions, computed whole on every cp rank (the all-gather fallback's
second form, plan `cp=N`).

An op whose result pairs positions with positions (relative positions i - j, a mask built as
mask[:, None] * mask[None, :], scores q k^T that the ring does not take over, DeBERTa's
disentangled attention) has no share of its own on a rank: its output runs along the sequence
twice. passes/cp_fallback.py gathers its inputs and runs it; where two or more dims of the
result run along the sequence, the result is kept whole (every rank computes the same value,
in global order) and marked `cp_whole` in its meta. Everything computed from it then runs on
the whole values too (`run_whole`: the op rerun on the whole fakes for its new shape), with its
shape arguments derived again (`regrow`: a view or expand of the whole value keeps its
traced dims but those that grew), until an op gives back one dim along the sequence (the
probabilities times the gathered values): the fallback cuts that back to this rank's blocks.
Exact, since every rank computes what one process computes; the gradients of the whole
values flow back through the gathers' reduce-scatters. An op that names the local length in
another argument (a number in arithmetic equal to s/cp, a slice to it) is refused: it cannot
tell a length from a coincidence of sizes.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from threefold.errors import PlanError
from threefold.ops.families import RESHAPES, SLICING, args_of, op_name

WHOLE = "cp_whole"
TWIN = "cp_twin"   # a node built by cp in the model's stead: the name of the node it stands for


def is_whole(x) -> bool:
    return isinstance(x, fx.Node) and bool(x.meta.get(WHOLE))


def mark(node: fx.Node, traced, full) -> None:
    """Record that `node`'s value is now `full` (its traced value: `traced`)."""
    node.meta["val"] = full
    if _shapes(full) != _shapes(traced):
        node.meta[WHOLE] = True


def _shapes(v):
    if isinstance(v, (tuple, list)):
        return tuple(_shapes(x) for x in v)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def regrow(node: fx.Node, n: int, why: str, stage=None) -> None:
    """Rewrite the shape argument of a view / reshape / expand whose input was made whole (its
    grown dims carried to the output), so that it runs on the whole value. Other ops must not
    name the local length n in their arguments (a PlanError `why`)."""
    name = op_name(node)
    if name in RESHAPES or name == "expand":
        a = args_of(node)
        src = a["self"]
        old, new = _traced(src), src.meta["val"].shape
        if old is None or tuple(old) == tuple(new):
            return
        out = node.meta["val"].shape
        size = _view_size(old, new, out) if name in RESHAPES else _expand_size(old, new, a["size"])
        if size is None:
            raise PlanError(f"{why} (its {name} to {tuple(out)} cannot be carried to the whole sequence)")
        names = [arg.name for arg in node.target._schema.arguments]
        key = "size" if "size" in names else "shape"      # view / expand: size; reshape: shape
        i = names.index(key)
        if i < len(node.args):
            node.args = node.args[:i] + (list(size),) + node.args[i + 1:]
        else:
            node.kwargs = {**node.kwargs, key: list(size)}
        return
    if name in SLICING:
        _full_range(node, name, why, stage)
    if names_length(node, n, stage):
        raise PlanError(f"{why} (it names the number {n}, the local length s/cp, beside a value computed on "
                        "the whole sequence: a length or a coincidence of sizes; use another sequence length "
                        "or cp=1)")


def _full_range(node: fx.Node, name: str, why: str, stage=None) -> None:
    """A slice along a dim of positions computed whole must keep all of it: its bounds were
    traced at the local length (t - 1, t // 2 ...) and would cut the whole one wrongly. Unless
    the model traced at the whole length (stage.retrace) has the same slice of a value of the
    whole shape: its bounds there are the whole length's (`position_ids[:, :1]` keeps 0:1,
    `x[:, :t - 1]` becomes 0:s - 1)."""
    a = args_of(node)
    src = a.get("self", a.get("input"))
    old = _traced(src) if isinstance(src, fx.Node) else None
    if old is None or a.get("dim") is None:
        return
    new = src.meta["val"].shape
    d = a["dim"] % len(new)
    if old[d] == new[d]:
        return
    if name == "slice" and a["start"] in (0, None) and (a["end"] is None or a["end"] >= old[d]) and a["step"] == 1:
        return
    if _bounds_at_whole(node, name, tuple(new), stage):
        return
    raise PlanError(f"{why} (it runs {name} along positions computed whole, with bounds traced at the local "
                    "length: cp cannot carry them to the whole sequence)")


def _bounds_at_whole(node: fx.Node, name: str, shape: tuple, stage) -> bool:
    """Take the integer arguments of node's twin at the whole length where it slices a value of
    `shape` by the same op (True), else leave node as it is (False)."""
    twin = _twin_at_whole(node, stage)
    if twin is None or op_name(twin) != name or len(twin.args) != len(node.args) or set(twin.kwargs) != set(node.kwargs):
        return False
    src = args_of(twin)
    src = src.get("self", src.get("input"))
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor) \
            or tuple(src.meta["val"].shape) != shape:
        return False
    ints = lambda v: isinstance(v, int) and not isinstance(v, bool)   # noqa: E731
    pairs = list(zip(node.args[1:], twin.args[1:])) + [(node.kwargs[k], twin.kwargs[k]) for k in node.kwargs]
    if any(isinstance(x, fx.Node) or isinstance(y, fx.Node) or ints(x) != ints(y) or (not ints(x) and x != y)
           for x, y in pairs):
        return False
    node.args = node.args[:1] + tuple(twin.args[1:])
    node.kwargs = dict(twin.kwargs)
    return True


def _traced(src: fx.Node):
    return src.meta.get("cp_traced_shape")


def _view_size(old, new, out):
    """The view of `new` (a whole value; `old` its traced shape) matching view `out` of `old`:
    dims grouped where the running products agree, a group that grew must be one dim on both
    sides (a merged or split dim that grew is not guessed)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(out):
        gi, gj = [i] if i < len(old) else [], [j] if j < len(out) else []
        pi = old[i] if i < len(old) else 1
        pj = out[j] if j < len(out) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pi != pj:
            if pi < pj and i < len(old):
                pi *= old[i]
                gi.append(i)
                i += 1
            elif j < len(out):
                pj *= out[j]
                gj.append(j)
                j += 1
            else:
                return None
        groups.append((gi, gj))
    size = list(out)
    for gi, gj in groups:   # the whole length need not be a multiple of the local one (a padded sequence)
        was, now = math.prod(old[k] for k in gi), math.prod(new[k] for k in gi)
        if was == now:
            continue
        if len(gj) == 1:
            size[gj[0]] = now
        elif len(gi) == 1 and sum(out[k] != 1 for k in gj) == 1:
            k = next(k for k in gj if out[k] != 1)
            if out[k] * now % was:
                return None
            size[k] = out[k] * now // was
        else:
            return None
    return size


def _expand_size(old, new, size):
    size = list(size)
    lead = len(size) - len(old)
    for k in range(len(old)):
        if old[k] != new[k] and size[lead + k] != -1:
            size[lead + k] = new[k]
    return size


def names_length(node: fx.Node, n: int, stage=None) -> bool:
    """An integer argument equal to the local length n (besides the first operand): on the
    whole sequence it would be wrong (a length) or a coincidence of sizes. A coincidence is
    told apart where the model traced at the whole length (stage.retrace) has the same op
    with the same number there: a constant that does not change with the length is no length."""
    found = _ints(node)
    if not any(v == n for _, v in found):
        return False
    twin = _twin_at_whole(node, stage)
    if twin is None:
        return True
    theirs = dict(_ints(twin))
    return any(v == n and theirs.get(at) != n for at, v in found)


def _ints(node: fx.Node) -> list:
    """(where, value) of every integer among node's arguments but the first, and but those the
    op's schema names as dims (`dim`, `dim0`, `axis1`: an index of a dim, never a length)."""
    out = []
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    dims = {k for k in names if k.startswith(("dim", "axis"))}

    def look(a, at):
        if isinstance(a, (list, tuple)):
            for i, x in enumerate(a):
                look(x, at + (i,))
        elif isinstance(a, int) and not isinstance(a, bool):
            out.append((at, a))
    for i, a in enumerate(node.args[1:]):
        if i + 1 >= len(names) or names[i + 1] not in dims:
            look(a, ("arg", i))
    for k, a in node.kwargs.items():
        if k not in dims:
            look(a, ("kw", k))
    return out


def _twin_at_whole(node: fx.Node, stage):
    """node's op in the model traced at the whole length (same name, same target), or None."""
    twin = twin_named(node, stage)
    return twin if twin is not None and twin.target == node.target else None


def whole_length(stage) -> int:
    """The length a value computed whole has along the sequence: S, the real one (a sequence
    padded for cp's 2cp blocks is whole without its padding: one process's value)."""
    return stage.seq_len * stage.plan.cp - getattr(stage, "seq_tail", 0)


def twin_named(node: fx.Node, stage):
    """The node of node's name (or of the one it stands for, TWIN) in the model traced at the
    whole length (stage.retrace), or None where there is no such trace or node."""
    if getattr(stage, "retrace", None) is None:
        return None
    try:
        graph = stage.retrace(whole_length(stage))
    except Exception:   # the model does not trace at the whole length: no answer, no guess
        return None
    name = node.meta.get(TWIN, node.name)
    return next((t for t in graph.nodes if t.name == name), None)


def run_whole(node: fx.Node, n: int, why: str, stage=None) -> None:
    """`node` reads whole values only (no input split along the sequence): rerun it on their
    whole fakes, its shape arguments carried over (regrow); its output is whole too."""
    traced = node.meta.get("val")
    regrow(node, n, why, stage)
    val = one_mode(node)
    try:
        full = node.target(*fx.node.map_arg(node.args, val), **fx.node.map_arg(node.kwargs, val))
    except Exception as exc:
        full = _runtime_op_whole(node, traced)
        if full is None:
            raise PlanError(f"{why} (and it cannot run on the whole sequence: {type(exc).__name__})") from None
    remember(node, traced)
    mark(node, traced, full)


def _runtime_op_whole(node: fx.Node, traced):
    """The whole value of a runtime op placed by another axis (tp's scatter of heads), which
    cannot run on fakes outside its group: the traced value with the grown dims of its one whole
    input, where the op keeps those dims and names none of them (it acts on heads or features,
    never on positions); else None."""
    if isinstance(node.target, torch._ops.OpOverload) or not isinstance(traced, torch.Tensor):
        return None
    grown = [a for a in node.all_input_nodes if _traced(a) is not None and tuple(_traced(a)) != tuple(a.meta["val"].shape)]
    if len(grown) != 1 or len(_traced(grown[0])) != traced.dim():
        return None
    old, new = _traced(grown[0]), grown[0].meta["val"].shape
    dims = [d for d in range(traced.dim()) if old[d] != new[d]]
    named = {v % traced.dim() for v in args_of(node).values() if isinstance(v, int) and not isinstance(v, bool)}
    if any(traced.shape[d] != old[d] or d in named for d in dims):
        return None
    shape = [new[d] if d in dims else traced.shape[d] for d in range(traced.dim())]
    if not isinstance(traced, FakeTensor):
        return torch.empty(shape, dtype=traced.dtype, device=traced.device)
    with traced.fake_mode:
        return torch.empty(shape, dtype=traced.dtype, device=traced.device)


def one_mode(node: fx.Node):
    """a -> its value, in one kind of tensor for node's op: meta tensors where any input is on
    the meta device (tp's rewrite leaves some), else fakes of the fake mode another input's value
    is in (a whole arange beside a table's fake); only shapes are read from them."""
    vals = [a.meta.get("val") for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    meta = any(v.device.type == "meta" for v in vals)
    fake = next((v for v in vals if isinstance(v, FakeTensor)), None)

    def val(a):
        v = a.meta["val"]
        if not isinstance(v, torch.Tensor) or (meta and v.device.type == "meta") \
                or (not meta and (fake is None or isinstance(v, FakeTensor))):
            return v
        if meta:
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        with fake.fake_mode:
            return torch.empty(v.shape, dtype=v.dtype, device=fake.device)
    return val


def remember(node: fx.Node, traced) -> None:
    """Keep the traced shape beside the whole one (regrow reads it at the node's users)."""
    if isinstance(traced, torch.Tensor):
        node.meta.setdefault("cp_traced_shape", tuple(traced.shape))
