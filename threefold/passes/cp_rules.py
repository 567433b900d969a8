"""Context parallelism's sequence rules: one pure function per op or op family.

Each value is one of: not along the sequence (None: parameters, constants, values of them),
split along the sequence at dim d (`Seq(d)`: this rank holds its positions' rows there; a
dim that merges the sequence with its neighbours, [b*s, h] after a flatten, counts too, its
positions a digit of size n with `inner` elements inside each), or
a partial sum over this rank's tokens (`PARTIAL`: the loss numerator, summed over the batch
axes by the runtime).

A rule reads one call (`Call`: the op's name, its arguments by schema name, the input
placements, the traced shapes) and returns a decision: `Place(out)` (the output's
placement), `Gather(why)` (it mixes positions; exact on the all-gathered sequence,
passes/cp_fallback.py) or `Refuse(why)` (a PlanError naming the op and the fix). Rules never
touch the graph: passes/context_parallel.py applies the decisions. Rules are registered by
op name (`RULES`) or by family (threefold/ops/families.py, `FAMILY_RULES`); `decision_for`
says, for any op name, which rule (or reasoned refusal) cp has for it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from math import prod
from typing import Callable

import torch
import torch.fx as fx

from threefold.compiler.program import tf
from threefold.ops import families as fam
from threefold.ops.families import args_of, op_name
from threefold.ops.rules import Registry

__all__ = ["Seq", "PARTIAL", "Call", "Place", "Gather", "Refuse", "decide", "decision_for", "op_name"]


@dataclass(frozen=True)
class Seq:
    dim: int
    inner: int = 1     # elements of `dim` inside each position (1: positions are the innermost digit)

    def at(self, dim: int) -> "Seq":
        """The same positions, moved to `dim`."""
        return Seq(dim, self.inner)


PARTIAL = "partial"


@dataclass(frozen=True)
class Place:
    out: object            # Seq | PARTIAL | None, or a tuple of them for several outputs


@dataclass(frozen=True)
class Gather:
    why: str               # mixes positions: run on the gathered sequence, cut back


@dataclass(frozen=True)
class Refuse:
    why: str
    table: object = None   # the whole operand that varies per position, where that is why


@dataclass(frozen=True)
class Call:
    """One op call as a rule sees it (read only)."""
    node: fx.Node
    name: str
    args: dict             # by schema name, defaults filled
    state: dict            # node -> placement of what ran before
    stage: object          # plan (cp), seq_len, read only

    def place(self, x):
        return self.state.get(x) if isinstance(x, fx.Node) else None

    @property
    def out(self):
        return self.node.meta.get("val")

    @property
    def x(self):
        """The first tensor argument (self / input)."""
        for k in ("self", "input", "x"):
            if k in self.args:
                return self.args[k]
        return self.node.args[0] if self.node.args else None


class _NoRule(Exception):
    def __init__(self, why: str, table=None):
        super().__init__(why)
        self.table = table


def _fail(call: Call, why: str, table=None):
    raise _NoRule(why, table)


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _norm(d, rank):
    return d % rank if rank else d


# -- registry --------------------------------------------------------------------------------

REGISTRY = Registry("cp")                # the registry mechanics every axis shares (ops/rules.py)
RULES: dict[str, Callable] = REGISTRY.by_name           # op name -> rule
FAMILY_RULES: dict[str, Callable] = REGISTRY.by_family  # family -> rule
REFUSALS: dict[str, str] = REGISTRY.refusals            # op name -> why cp has no rule (reasoned refusal)
# families whose ops are exact on the gathered sequence when no position-wise rule applies
GATHERABLE = {"reduction", "softmax", "scan", "sort", "conv", "pool", "matmul", "pad", "attention"}


rule = REGISTRY.rule


def decision_for(name: str, node: fx.Node | None = None):
    """The rule cp applies to op `name` (a function), or the reason it has none (a str)."""
    if name in RULES:
        return RULES[name]
    f = fam.family(node if node is not None else name)
    if f in FAMILY_RULES:
        return FAMILY_RULES[f]
    if name in REFUSALS:
        return REFUSALS[name]
    base = name[:-1] if name.endswith("_") else name
    if base != name and (base in RULES or fam.family(base) in FAMILY_RULES):
        return decision_for(base)                          # in-place variants (add_, clamp_) follow theirs
    return "has no context-parallel rule (it may mix sequence positions)"


def decide(node: fx.Node, state: dict, stage):
    """The decision for one call whose inputs include a sequence-split or partial value."""
    name = op_name(node)
    call = Call(node, name, args_of(node) if node.op == "call_function" else {}, state, stage)
    if any(state.get(a) == PARTIAL for a in node.all_input_nodes) and node.target is not operator.getitem:
        return _partial(call)
    r = decision_for(name, node)
    if isinstance(r, str):
        return Gather(r) if fam.family(node) in GATHERABLE else Refuse(r)
    try:
        d = r(call)
    except _NoRule as exc:
        return Gather(str(exc)) if fam.family(node) in GATHERABLE else Refuse(str(exc), exc.table)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:   # arguments it cannot read
        why = f"has arguments cp's {name} rule cannot read ({type(exc).__name__}: {exc})"
        return Gather(why) if fam.family(node) in GATHERABLE else Refuse(why)
    return d if isinstance(d, (Place, Gather, Refuse)) else Place(d)


def _partial(call: Call):
    """A per-rank partial loss sum may only be scaled, cast or viewed (it is summed later)."""
    n = call.node
    ins = n.all_input_nodes
    linear = {"mul", "div", "neg", "add", "sub", "squeeze", "unsqueeze"} | fam.VIEWS | fam.COPIES
    if call.name in linear and sum(call.place(a) == PARTIAL for a in ins) == 1 \
            and not any(isinstance(call.place(a), Seq) for a in ins):
        if call.name in ("add", "sub") and any(isinstance(a, fx.Node) and call.place(a) is None and _val(a) is not None
                                               for a in n.args[:2]):
            return Refuse("adds a whole value to a per-rank partial loss")
        return Place(PARTIAL)
    return Refuse("reads a partial (per-rank) loss sum")


REFUSALS.update({
    "scaled_dot_product_attention": "is attention the ring did not take over",
    "call_loss": "is a loss run as Python (untraceable): cp cannot tell how it reduces over the sequence",
})


# -- rules -----------------------------------------------------------------------------------

@rule("getitem")
def _getitem(c: Call):
    s = c.place(c.node.args[0])
    return s[c.node.args[1]] if isinstance(s, tuple) else s


@rule("_assert_tensor_metadata")
def _no_value(c: Call):
    return None


@rule("ring_attention")
def _ring(c: Call):
    return Seq(c.out.dim() - 2)


@rule("key_bias")
def _key_bias(c: Call):
    """A key-side padding mask: split along its last (key) dim."""
    if any(c.place(a) != Seq(_val(a).dim() - 1) for a in c.node.all_input_nodes):
        _fail(c, "takes a mask that is not split along its key dim")
    return Seq(c.out.dim() - 1)


@rule("causal_conv1d")
def _causal_conv(c: Call):
    s0 = c.place(c.x)
    if s0 is None or s0.dim != _val(c.x).dim() - 1:
        _fail(c, "convolves along a dim that is not the sequence")
    return s0


@rule("shard_seq")
def _shard_seq(c: Call):
    return Seq(c.args["dim"])


@rule(family="pointwise")
def _pointwise(c: Call):
    out = c.out
    several = isinstance(out, (tuple, list))
    out = out[0] if several else out
    r = out.dim() if isinstance(out, torch.Tensor) else 0
    operands = [a for v in c.args.values() for a in (v if isinstance(v, (list, tuple)) else [v])]
    places = {c.place(a).at(c.place(a).dim + r - _val(a).dim()) for a in operands if isinstance(c.place(a), Seq)}
    if len(places) != 1:
        _fail(c, "combines values split along different dims")
    s = places.pop()
    d = s.dim
    for a in operands:
        v = _val(a)
        if c.place(a) is None and isinstance(v, torch.Tensor):
            i = d - (r - v.dim())
            if i >= 0 and v.shape[i] != 1:
                _fail(c, "combines the sequence with a value that varies per position but is not computed "
                      "from the inputs (a table sliced to the sequence length?)", a)
    return tuple(s for _ in c.out) if several else s


RULES.update({n: _pointwise for n in fam.COPIES | fam.LIKE_FACTORIES | {"copy", "copy_"}})


@rule(family="dim_move")
def _dim_move(c: Call):
    s0, a, name = c.place(c.x), c.args, c.name
    out, rin = c.out, _val(c.x).dim()
    if not isinstance(s0, Seq):
        _fail(c, "moves dims of a whole value by a split one")
    if name in ("expand", "expand_as", "broadcast_to"):
        return s0.at(s0.dim + out.dim() - rin)
    if name == "unsqueeze":
        d = _norm(a["dim"], out.dim())
        return s0.at(s0.dim + (1 if d <= s0.dim else 0))
    if name == "squeeze":
        shape = _val(c.x).shape
        dims = a.get("dim")
        dims = [i for i, n in enumerate(shape) if n == 1] if dims is None else [dims] if isinstance(dims, int) else dims
        dims = [_norm(d, len(shape)) for d in dims if shape[_norm(d, len(shape))] == 1]
        return s0.at(s0.dim - sum(d < s0.dim for d in dims))
    if name in ("transpose", "swapaxes"):
        x0, x1 = (a["dim0"], a["dim1"]) if "dim0" in a else (a["axis0"], a["axis1"])
        x0, x1 = _norm(x0, rin), _norm(x1, rin)
        return s0.at({x0: x1, x1: x0}.get(s0.dim, s0.dim))
    if name == "t":
        return s0.at(1 - s0.dim) if out.dim() == 2 else s0
    if name == "permute":
        return s0.at([_norm(d, rin) for d in a["dims"]].index(s0.dim))
    if name == "movedim":
        order = [d for d in range(rin)]
        src, dst = a["source"], a["destination"]
        src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
        perm = [None] * rin
        for s_, d_ in zip(src, dst):
            perm[_norm(d_, rin)] = _norm(s_, rin)
        rest = iter(d for d in order if d not in {_norm(s_, rin) for s_ in src})
        perm = [p if p is not None else next(rest) for p in perm]
        return s0.at(perm.index(s0.dim))
    _fail(c, "moves dims in a way cp does not know")


@rule(family="view")
def _view(c: Call):
    """The output dim that holds the positions digit (n positions, `inner` elements each) whole."""
    s0 = c.place(c.x)
    if not isinstance(s0, Seq):
        _fail(c, "views a whole value by a split one")
    shape_in, d, shape_out, n = _val(c.x).shape, s0.dim, c.out.shape, c.stage.seq_len
    stride = s0.inner * prod(shape_in[d + 1:])      # elements per position, in the flat order
    for e in reversed(range(len(shape_out))):
        after = prod(shape_out[e + 1:])
        if stride % after == 0 and shape_out[e] % (stride // after * n) == 0:
            return Seq(e, stride // after)
    _fail(c, f"reshapes {tuple(shape_in)} -> {tuple(shape_out)} across the sequence dim {d}")


@rule(family="slicing")
def _slicing(c: Call):
    name, a = c.name, c.args
    s0, src = c.place(c.x), _val(c.x)
    d = _norm(a.get("dim", 0) if a.get("dim") is not None else 0, src.dim())
    if name == "index_select":
        si = c.place(a["index"])
        if s0 is None and isinstance(si, Seq):    # table.index_select(d, positions): a lookup
            return si.at(d)
        if s0 is None or d == s0.dim or si is not None:
            _fail(c, "indexes along the sequence")
        return s0
    if s0 is None or any(isinstance(c.place(v), Seq) for k, v in a.items() if k not in ("self", "input")):
        _fail(c, "slices with split positions")
    if d == s0.dim:
        if name == "slice" and a.get("start") in (0, None) and (a.get("end") is None or a["end"] >= src.shape[d]) \
                and a.get("step", 1) == 1:
            return s0
        _fail(c, f"slices along the sequence (dim {d})")
    if name in ("select", "unbind"):
        s = s0.at(s0.dim - (1 if d < s0.dim else 0))
        return tuple(s for _ in c.out) if name == "unbind" else s
    if isinstance(c.out, (tuple, list)):
        return tuple(s0 for _ in c.out)
    return s0


@rule(family="join")
def _join(c: Call):
    tensors = c.args["tensors"]
    rank_in = max(_val(t).dim() for t in tensors)
    d = _norm(c.args.get("dim", 0), rank_in + (c.name == "stack"))
    if c.name == "cat":   # empty operands (a KV cache that starts empty, cat([], k)) add nothing
        tensors = [t for t in tensors if _val(t).numel() > 0 or isinstance(c.place(t), Seq)]
    places = {c.place(t) for t in tensors if isinstance(c.place(t), Seq)}
    if len(places) != 1 or any(c.place(t) is None for t in tensors):
        _fail(c, "joins values split along the sequence with others")
    s0 = places.pop()
    if c.name == "cat":
        if d == s0.dim and len(tensors) > 1:
            _fail(c, "concatenates along the sequence")
        return s0
    return s0.at(s0.dim + (1 if d <= s0.dim else 0))


@rule(family="repeat")
def _repeat(c: Call):
    """repeat / tile (whole-tensor repeats) and repeat_interleave along one dim: position-wise
    unless they repeat along the sequence (GQA's repeat of K/V heads is along heads)."""
    s0, src = c.place(c.x), _val(c.x)
    if s0 is None or c.name == "repeat_interleave" and "self" not in c.args:
        _fail(c, "repeats split positions")
    if c.name == "repeat_interleave":
        if c.args.get("dim") is None:
            _fail(c, "repeats the flattened sequence")
        if isinstance(c.place(c.args.get("repeats")), Seq) or _norm(c.args["dim"], src.dim()) == s0.dim:
            _fail(c, "repeats along the sequence")
        return s0
    reps = list(c.args.get("repeats") or c.args.get("dims"))
    e = s0.dim + len(reps) - src.dim() if len(reps) >= src.dim() else s0.dim
    if len(reps) >= src.dim() and reps[e] != 1 or len(reps) < src.dim() and s0.dim >= src.dim() - len(reps) \
            and reps[s0.dim - (src.dim() - len(reps))] != 1:
        _fail(c, "repeats along the sequence")
    return s0.at(e)


def _reduced_dims(c: Call, rank: int):
    """The dims a reduction runs over (by name), or None for all of them."""
    dims = c.args.get("dim")
    if dims is None or dims == [] or dims == ():
        return None
    return [_norm(d, rank) for d in ([dims] if isinstance(dims, int) else dims)]


@rule(family="reduction")
def _reduce(c: Call):
    s0, src = c.place(c.x), _val(c.x)
    if not isinstance(s0, Seq):
        _fail(c, "reduces a whole value with a split one")
    dims = _reduced_dims(c, src.dim())
    if dims is None:
        if c.name in ("sum", "mean") and _loss_path(c.node):
            return PARTIAL
        _fail(c, "reduces over every position")
    if s0.dim in dims:
        if c.name in ("sum", "mean") and len(dims) == src.dim() and _loss_path(c.node):
            return PARTIAL
        _fail(c, f"reduces along the sequence (dim {s0.dim})")
    s = s0.at(s0.dim if c.args.get("keepdim") else s0.dim - sum(d < s0.dim for d in dims))
    return tuple(s for _ in c.out) if isinstance(c.out, (tuple, list)) else s


@rule(family="softmax")
@rule(family="scan")
@rule(family="sort")
def _along_dim(c: Call):
    """Ops that run along one dim (read by name: topk's second argument is k): position-wise
    unless that dim is the sequence."""
    s0, src = c.place(c.x), _val(c.x)
    if not isinstance(s0, Seq):
        _fail(c, "runs a whole value along a split one")
    d = c.args.get("dim")
    d = _norm((0 if c.name == "msort" else -1) if d is None else d, src.dim())
    if d == s0.dim:
        _fail(c, f"runs along the sequence (dim {d})")
    if c.name == "kthvalue" and not c.args.get("keepdim"):
        s0 = s0.at(s0.dim - (d < s0.dim))
    return tuple(s0 for _ in c.out) if isinstance(c.out, (tuple, list)) else s0


@rule(family="layer_norm")
def _layer_norm(c: Call):
    s0, shape = c.place(c.x), c.args["normalized_shape"]
    if s0 is None or s0.dim >= _val(c.x).dim() - len(shape):
        _fail(c, "normalizes over the sequence")
    return (s0, s0, s0) if c.name == "native_layer_norm" else s0


@rule(family="matmul")
def _matmul(c: Call):
    if c.name == "einsum":
        return _einsum(c)
    if c.name == "outer":
        sa, sb = c.place(c.args["self"]), c.place(c.args["vec2"])
        if sa is not None and sb is not None:
            _fail(c, "multiplies two split position vectors")
        return Seq(0) if sa is not None else Seq(1)
    a, b = (c.args["mat1"], c.args["mat2"]) if c.name == "addmm" else \
        (c.args["batch1"], c.args["batch2"]) if c.name == "baddbmm" else \
        (c.args["input"], c.args["weight"]) if c.name == "linear" else (c.args["self"], c.args.get("mat2", c.args.get("other")))
    if c.name in ("addmm", "baddbmm") and isinstance(c.place(c.args["self"]), Seq):
        _fail(c, "adds a split bias to a contraction")
    sa, sb, out = c.place(a), c.place(b), c.out
    ra = _val(a).dim()
    if c.name == "linear" or sb is None:
        if sa is None or (ra > 1 and sa.dim == ra - 1) or (c.name != "linear" and ra == 1):
            _fail(c, "contracts over the sequence")
        return sa.at(sa.dim + out.dim() - ra)
    rb = _val(b).dim()
    if sa is None:
        if sb.dim == rb - 2 or rb == 1:
            _fail(c, "contracts over the sequence")
        if sb.dim == rb - 1:
            return sb.at(out.dim() - 1)
        return sb.at(sb.dim + out.dim() - rb)
    if sa.dim < ra - 2 and sb.dim < rb - 2 and sa.dim - ra == sb.dim - rb:   # both split: a shared batch dim
        return sa.at(sa.dim + out.dim() - ra)
    _fail(c, "contracts over the sequence (attention not recognised as such?)")


def _einsum(c: Call):
    """Position-wise when every split operand carries the sequence under one letter that the
    output keeps and no whole operand varies along."""
    eq, tensors = c.args["equation"].replace(" ", ""), c.args["tensors"]
    ins, _, outs = eq.partition("->")
    subs = ins.split(",")
    free = iter(ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in eq)
    ell = None
    expanded = []
    for s_, t in zip(subs, tensors):
        if "..." in s_:
            k = _val(t).dim() - (len(s_) - 3)
            ell = ell or "".join(next(free) for _ in range(max(k, 0)))
            s_ = s_.replace("...", ell[len(ell) - k:] if k else "")
        expanded.append(s_)
    if not _ and not outs:
        letters = "".join(expanded)
        outs = (ell or "") + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1 and ch not in (ell or "")))
    outs = outs.replace("...", ell or "")
    seq = {(s_[c.place(t).dim], c.place(t).inner) for s_, t in zip(expanded, tensors) if isinstance(c.place(t), Seq)}
    if len(seq) != 1:
        _fail(c, "contracts split operands along different letters")
    letter, inner = seq.pop()
    if letter not in outs:
        _fail(c, "contracts over the sequence")
    if any(c.place(t) is None and letter in s_ and _val(t).shape[s_.index(letter)] != 1
           for s_, t in zip(expanded, tensors)):
        _fail(c, "meets a whole operand along the sequence")
    return Seq(outs.index(letter), inner)


@rule(family="embedding")
def _embedding(c: Call):
    table = c.args.get("weight")
    idx = c.args.get("indices", c.args.get("ids"))
    si = c.place(idx)
    if c.place(table) is not None or si is None:
        _fail(c, "looks up a table that is split along the sequence")
    return si


@rule("index")
def _index(c: Call):
    """x[..., idx, ...] with x split along the sequence at d: exact when the index at d is the
    local identity, arange(n) (HF's padding mask read as mask[batch_idx, kv_idx]; the cp pass
    keeps such an arange local), and no other index varies along it."""
    from threefold.passes.cp_masks import evaluate
    x, indices = c.args["self"], list(c.args["indices"])
    s0, n = c.place(x), c.stage.seq_len
    split = [i for i, a in enumerate(indices) if isinstance(c.place(a), Seq)]
    if s0 is None and split:                       # table[positions]: a lookup at this rank's positions
        given = [i for i, a in enumerate(indices) if a is not None]
        shapes = [_val(indices[i]).shape for i in given]
        bshape = torch.broadcast_shapes(*shapes)
        places = {c.place(indices[i]).at(c.place(indices[i]).dim + len(bshape) - _val(indices[i]).dim())
                  for i in split}
        if len(places) != 1 or given != list(range(given[0], given[-1] + 1)):
            _fail(c, "indexes a whole value with positions split along different dims")
        p = places.pop()
        return p.at(given[0] + p.dim)
    if not isinstance(s0, Seq) or s0.dim >= len(indices) or not isinstance(indices[s0.dim], fx.Node) or any(
            c.place(i) is not None for i in indices if isinstance(i, fx.Node)):
        _fail(c, "indexes along the sequence")
    try:
        v = evaluate(indices[s0.dim], c.stage)
    except Exception:
        _fail(c, "indexes along the sequence with an index it cannot read")
    varying = [e for e in range(v.dim()) if v.shape[e] == n]
    if len(varying) != 1 or not torch.equal(
            v, torch.arange(n).view([n if e == varying[0] else 1 for e in range(v.dim())]).expand(v.shape)):
        _fail(c, "indexes along the sequence (not with its own positions)")
    given = [i for i, a in enumerate(indices) if a is not None]
    shapes = [_val(indices[i]).shape for i in given]
    bshape = torch.broadcast_shapes(*shapes)
    e = varying[0] + len(bshape) - v.dim()
    if any(len(sh) - len(bshape) + e >= 0 and sh[len(sh) - len(bshape) + e] != 1
           for i, sh in zip(given, shapes) if i != s0.dim):
        _fail(c, "indexes along the sequence with indices that vary along it")
    adjacent = given == list(range(given[0], given[-1] + 1))
    return Seq((given[0] if adjacent else 0) + e)


@rule("gather", "scatter")
def _gather_scatter(c: Call):
    """aten.gather / scatter along a dim other than the sequence, index split like the source;
    or the runtime's tp scatter / gather (dim named too)."""
    s0, d = c.place(c.x), _norm(c.args["dim"], c.out.dim())
    if s0 is not None and d == s0.dim:
        _fail(c, "gathers or scatters along the sequence")
    others = [c.place(c.args[k]) for k in ("index", "src") if isinstance(c.args.get(k), fx.Node)]
    if isinstance(c.node.target, torch._ops.OpOverload) and any(o != s0 for o in others):
        _fail(c, "gathers with an index split differently from its source")
    return s0


@rule("scatter_blocks", "gather_blocks", "reduce_scatter", "all_gather_seq")
def _tp_seq_ops(c: Call):
    s0, d = c.place(c.x), _norm(c.args["dim"], c.out.dim())
    if s0 is not None and d == s0.dim:
        _fail(c, "splits or gathers along the sequence over tp")
    return s0


@rule(family="pad")
def _pad(c: Call):
    """Padding of other dims keeps positions; padding (shifting) the sequence is gathered."""
    s0, pad = c.place(c.x), list(c.args.get("pad") or [])
    if not isinstance(s0, Seq):
        _fail(c, "pads a whole value by a split one")
    k = _val(c.x).dim() - 1 - s0.dim            # pad pairs run from the last dim backwards
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        _fail(c, "pads (shifts) along the sequence")
    if s0.inner != 1 and k < len(pad) // 2:
        _fail(c, "pads a dim the sequence is merged into")
    return s0


@rule("one_hot")
def _one_hot(c: Call):
    """one_hot(x, classes): a new last dim of classes; each position's row alone."""
    return c.place(c.x)


@rule("view_as_complex", "view_as_real")
def _complex_view(c: Call):
    s0, rin = c.place(c.x), _val(c.x).dim()
    if c.name == "view_as_complex" and s0.dim == rin - 1:
        _fail(c, "views the sequence as complex pairs")
    return s0


@rule(family="loss")
def _loss(c: Call):
    name, node = c.name, c.node
    x = c.x if c.x is not None else node.args[0]
    s0 = c.place(x)
    if name.startswith("vocab_parallel_cross_entropy"):
        reduction = c.args.get("reduction", 1)
        reduction = 0 if reduction == "none" else reduction
    else:
        from threefold.passes.loss_form import _arg, _reduction_index
        reduction = _arg(node, _reduction_index(node), "reduction", 1)
    classes = name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd") and _val(x).dim() > 1
    if s0 is not None and classes and s0.dim == 1:
        _fail(c, "takes classes along the sequence dim")
    if reduction == 0:   # none: per position
        if s0 is None:
            return c.place(c.args.get("target", node.args[1]))
        return s0.at(s0.dim - 1) if classes and s0.dim > 1 else s0
    return PARTIAL


def _loss_path(node) -> bool:
    """The value reaches the graph output (the loss) through scalar ops only."""
    x = node
    for _ in range(16):
        users = [u for u in x.users if op_name(u) != "_assert_tensor_metadata"]
        if any(u.op == "output" for u in users):
            return True
        if len(users) != 1 or _val(users[0]) is None or _val(users[0]).dim() != 0:
            return False
        x = users[0]
    return False


def where(node: fx.Node) -> str:
    return tf(node).get("module") or "<top>"
