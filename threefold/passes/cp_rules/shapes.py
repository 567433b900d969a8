"""cp rules for ops that move, view, slice, join, repeat or pad a value: where its positions land."""
from __future__ import annotations

from math import prod

from threefold.ops.families import args_of, op_name
from threefold.passes.cp_masks import input_free
from threefold.ops.rules import Op
from threefold.passes.cp_rules.core import Call, Place, Seq, _fail, _norm, _val, rule
from threefold.runtime import cp_gather
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


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
        if name == "select":
            return _select_position(c, s0, d)
        if isinstance(c.out, (tuple, list)) and sum(v.shape[d] != 0 for v in c.out) == 1 \
                and all(v.shape[d] in (0, src.shape[d]) for v in c.out):
            return tuple(s0 for _ in c.out)   # the whole sequence in one piece, the rest empty (Mamba's cached tail)
        start = a.get("start") or 0
        start = start + src.shape[d] if isinstance(start, int) and start < 0 else start   # t[-n:] of n rows
        if name == "slice" and start <= 0 and (a.get("end") is None or a["end"] >= src.shape[d]) \
                and a.get("step", 1) == 1:
            return s0
        if input_free(c.x):   # made from arange over the sequence (global positions), not from the inputs
            _fail(c, f"slices positions made from arange over the sequence (dim {d}, [{start}:{a.get('end')}]: "
                  "such as a packed-sequence check reading position_ids[:, :1]); on this rank they are its own "
                  "blocks' positions, not the sequence's first ones, and cp does not yet compute such a value whole)")
        _fail(c, f"slices along the sequence (dim {d}; a shift such as x[:, :-1] inside the model? shift the "
              "tokens in the data instead)")
    if name in ("select", "unbind"):
        s = s0.at(s0.dim - (1 if d < s0.dim else 0))
        return tuple(s for _ in c.out) if name == "unbind" else s
    if isinstance(c.out, (tuple, list)):
        return tuple(s0 for _ in c.out)
    return s0


def _select_position(c: Call, s0: Seq, d: int):
    """x.select(seq, i) at a fixed position (a CLS token read as x[:, 0]): read on the rank that
    holds position i and summed over the cp group (cp_gather.select_seq), the same value on
    every rank; refused where the same value is read position by position (a recurrence)."""
    why, index = _steps(c, d), c.args.get("index")
    if why.startswith("reads the sequence one position at a time") or not isinstance(index, int) \
            or s0.inner != 1 or _val(c.x).shape[d] != c.stage.seq_len:
        _fail(c, why)
    return Place(None, Op(cp_gather.select_seq, (c.x, d, index, CP), {"ranks": c.stage.plan.cp}))


def _steps(c: Call, d: int) -> str:
    """Why a select of one position along the sequence is refused: where the same value is
    read one position at a time (x[:, t] for t = 0, 1, ...), a recurrence over time steps."""
    src = c.x
    at = sorted({args_of(u)["index"] for u in src.users
                 if op_name(u) == "select" and _norm(args_of(u)["dim"], _val(src).dim()) == d
                 and isinstance(args_of(u)["index"], int)})
    if len(at) > 1:
        return (f"reads the sequence one position at a time (select at t = {at[0]}..{at[-1]}, {len(at)} of "
                f"{_val(src).shape[d]} local positions): a recurrence over time steps (a Python loop unrolled in the "
                "trace, its state carried from step to step), which has no position-wise split (write it as a scan or a "
                "chunked form)")
    return f"selects one position along the sequence (dim {d}, index {args_of(c.node)['index']})"


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
        if src.shape[s0.dim] == c.stage.seq_len * s0.inner:
            _fail(c, "repeats along the sequence")
        # tiles of a dim that merges the sequence with an outer one ([b*s] rows repeated per
        # expert, Llama 4's MoE): one more outer digit, the positions digit where it was
    return s0.at(e)



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




@rule("shift_seq", "drop_tail")
def _shift_seq(c: Call):
    """A token shift by k along the split sequence (runtime/cp_shift.py): a halo exchange; the
    positions at the end of the whole sequence zeroed (runtime/cp_tail.drop_tail: they stand
    for nothing, or a look-ahead past an uneven sequence's real end reads zeros there)."""
    s0 = c.place(c.x)
    if not isinstance(s0, Seq) or s0.inner != 1 or s0.dim != _norm(c.args["dim"], _val(c.x).dim()):
        _fail(c, "shifts along a dim that is not the split sequence")
    return s0
