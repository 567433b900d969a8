"""Per-op rules: where the rows of the batch go through an ATen op, and which ops mix them.

Row states (None, Rows(dim, stride), LOST, POS) are described in passes/row_state.py.
`propagate(node, states, rows)` returns (state of the node, reason): the reason is a short
phrase when the op makes an output row depend on other rows (a reduction, scan or
contraction over the batch dim, an all-pairs product, a pick of rows by position or value,
a batch statistic), else None. Rules are pure functions registered by ATen schema name on
`ROWS` (the shared registry mechanics of threefold/ops/rules.py), grouped by family
(indexing ops in passes/row_index_rules.py); an op without a rule (or whose rule returns
None) maps rows through broadcasting (right-aligned dims of equal length), which is what
elementwise ops do. Positions (POS) pass only arithmetic on them, views and indexing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.ops import families as fam
from threefold.ops.rules import Registry
from threefold.passes.expert_match import expert_matmul
from threefold.passes.row_index_rules import index_rule
from threefold.passes.row_state import (LOST, POS, Rows, arg_of, dims_of, explicit_einsum, rows_of,
                                        shape_of, op_name)

# op -> index of its `training` argument (-1: always training)
BATCH_STAT_OPS = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                  "_native_batch_norm_legit_functional": 5, "cudnn_batch_norm": 5,
                  "miopen_batch_norm": 5, "_batch_norm_impl_index": 5,
                  "_batch_norm_with_update": -1, "_batch_norm_with_update_functional": -1}
_NO_STAT_NORMS = {"_native_batch_norm_legit_no_training", "_batch_norm_no_update"}


def propagate(node: fx.Node, states: dict, rows: int):
    """(row state of node's output, reason it mixes rows or None)."""
    state, reason = _propagate(node, states, rows)
    shape = shape_of(node)
    if isinstance(state, Rows) and state.stride == 0:
        # rows found without a stride (a rule that saw a whole dim): the batch factor is
        # the dim's outer factor ([B*T] after an index by positions)
        ok = shape and state.dim < len(shape) and rows and shape[state.dim] % rows == 0
        state = Rows(state.dim, shape[state.dim] // rows if ok else 1)
    return state, reason


# Every rule below is registered by ATen op name on ROWS (threefold/ops/rules.Registry) and
# gets a RowCall; it returns (row state, reason), or None for "as elementwise" (broadcast).
ROWS = Registry("rows")


@dataclass(frozen=True, eq=False)
class RowCall:
    """One call as a row rule sees it (read only)."""
    node: fx.Node
    name: str
    states: dict          # node -> row state of what ran before
    rows: int             # rows of the batch in one microbatch
    x: object             # the first argument
    sx: object            # its row state
    shape_x: tuple | None
    out: object           # the traced value


def _propagate(node: fx.Node, states: dict, rows: int):
    name = op_name(node)
    ins = {a: states.get(a) for a in node.all_input_nodes}
    if all(s is None for s in ins.values()):
        return None, None
    if name in fam.GROUPED_MATMULS or expert_matmul(node) is not None:
        # rows sorted by group, each multiplied by its own group's weight: per row (the
        # offsets, counted over all rows, only say where each group's rows start; an
        # expert matmul is the same structure under any op name, passes/experts.py)
        sx, sw = states.get(node.args[0]), states.get(node.args[1])
        return (sx, None) if sw is None and isinstance(sx, Rows) and sx.dim == 0 else (LOST, None)
    if name in fam.READS_SHAPE_ONLY:
        return None, None   # only the shape is read, which every microbatch has alike
    if node.meta.get("val") is None and not node.users:
        return None, None   # no value (an assertion on metadata)
    if any(s == LOST for s in ins.values()):
        return LOST, None
    if name == "getitem":
        s = states.get(node.args[0])
        return (s[node.args[1]] if isinstance(s, tuple) and node.args[1] < len(s) else s), None
    x = node.args[0] if node.args else None
    sx = rows_of(states, x)
    call = RowCall(node, name, states, rows, x, sx, shape_of(x), node.meta.get("val"))
    rule = ROWS.lookup(name)
    if sx == POS and name not in BATCH_STAT_OPS and name not in _NO_STAT_NORMS and name not in fam.POSITION_INDEXING:
        # positions of rows (nonzero, argsort) pass through arithmetic on them and views only
        if name in fam.POSITION_ARITHMETIC and all(states.get(a) is None for a in node.all_input_nodes if a is not x):
            return POS, None   # perm // k: positions of the rows the (row, k) pairs came from
        return (POS, None) if name in fam.ROW_VIEWS else (LOST, None)
    decided = rule(call) if callable(rule) else None
    return decided if decided is not None else _broadcast(node, states)


@ROWS.rule(*BATCH_STAT_OPS)
def _batch_stats(c: RowCall):
    idx = BATCH_STAT_OPS[c.name]
    training = True if idx < 0 else arg_of(c.node, idx, "training", False)
    if training and isinstance(c.sx, Rows) and c.sx.dim == 0:
        return _same_tuple(c.out, c.sx), "batch statistics"
    if training:
        return LOST, "batch statistics"
    return _same_tuple(c.out, c.sx), None


@ROWS.rule(*_NO_STAT_NORMS)
def _no_stat_norm(c: RowCall):
    return _same_tuple(c.out, c.sx), None


@ROWS.rule(*fam.ROW_LOSSES)
def _loss_rule(c: RowCall):
    return _loss(c.node, c.states)


@ROWS.rule(*fam.ROW_REDUCTIONS)
def _reduction(c: RowCall):
    x = c.x
    if isinstance(c.sx, Rows) and isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
        return _reduce(c.node, c.name, c.sx, tuple(x.meta["val"].shape))   # only its rank is read
    return None


@ROWS.rule(*fam.ALONG_ONE_DIM)
def _scan(c: RowCall):
    node, name, sx, shape_x, out = c.node, c.name, c.sx, c.shape_x, c.out
    if not isinstance(sx, Rows):
        return None
    if name in ("sort", "argsort") and shape_x:
        dim = arg_of(node, 1, "dim", -1)
        if isinstance(dim, int) and dim % len(shape_x) == sx.dim:
            # a permutation of the rows: the values are the rows in another order, the
            # indices their positions (indexing rows with them, and back, stays per-row)
            return ((Rows(sx.dim), POS) if name == "sort" else POS), None
    dim = arg_of(node, 1, "dim", -1)
    if name in ("topk", "kthvalue"):
        dim = arg_of(node, 2, "dim", -1)
    if name in ("flip", "roll"):
        dims = arg_of(node, 1, "dims") if name == "flip" else arg_of(node, 2, "dims", None)
        hit = dims is None or sx.dim in dims_of(dims, len(shape_x or ()))
        return _same_tuple(out, sx), (f"{name} over the batch dim" if hit else None)
    if isinstance(dim, int) and shape_x and dim % len(shape_x) == sx.dim:
        return _same_tuple(out, sx), f"{name} over the batch dim"
    return _same_tuple(out, sx), None


@ROWS.rule("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")
def _layer_norm(c: RowCall):
    norm = arg_of(c.node, 1, "normalized_shape", ())
    if isinstance(c.sx, Rows) and c.shape_x and c.sx.dim >= len(c.shape_x) - len(norm):
        return _same_tuple(c.out, c.sx), "a normalisation over the batch dim"
    return _same_tuple(c.out, c.sx), None


@ROWS.rule("group_norm", "native_group_norm", "instance_norm")
def _group_norm(c: RowCall):
    if isinstance(c.sx, Rows) and c.sx.dim != 0:
        return _same_tuple(c.out, c.sx), "a normalisation over the batch dim"
    return _same_tuple(c.out, c.sx), None


@ROWS.rule(*fam.ROW_MATMULS)
def _matmul_rule(c: RowCall):
    return _matmul(c.node, c.name, c.states)


@ROWS.rule("einsum")
def _einsum_rule(c: RowCall):
    return _einsum(c.node, c.states)


@ROWS.rule("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")
def _sdpa_rule(c: RowCall):
    return _sdpa(c.node, c.states)


@ROWS.rule(*fam.ROW_CONVS)
def _conv(c: RowCall):
    node, sx = c.node, c.sx
    sw = rows_of(c.states, node.args[1] if len(node.args) > 1 else None)
    if sw is not None or not (sx is None or isinstance(sx, Rows) and sx.dim == 0):
        return LOST, "a convolution over the batch dim"
    return sx, None


@ROWS.rule("embedding")
def _embedding(c: RowCall):
    sw, si = c.sx, rows_of(c.states, c.node.args[1])
    if sw is not None:
        return LOST, "a lookup in a table built from the batch"
    return si, None


@ROWS.rule("cat", "concat", "concatenate", "stack")
def _cat_rule(c: RowCall):
    return _cat(c.node, c.name, c.states)


@ROWS.rule("split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split", "split_copy")
def _split(c: RowCall):
    name, sx, shape_x, out = c.name, c.sx, c.shape_x, c.out
    dim = arg_of(c.node, 1 if name == "unbind" else 2, "dim", 0)
    if isinstance(sx, Rows) and shape_x and dim % len(shape_x) == sx.dim:
        return LOST, f"{name} of the batch into parts by position"
    n = len(out) if isinstance(out, (list, tuple)) else 1
    if name == "unbind" and isinstance(sx, Rows) and sx.dim > dim % len(shape_x):
        return tuple(Rows(sx.dim - 1, sx.stride) for _ in range(n)), None
    return tuple(sx for _ in range(n)), None


@ROWS.rule("nonzero", "argwhere")
def _positions(c: RowCall):
    return POS, None


@ROWS.rule(*fam.INDEXING)
def _indexing(c: RowCall):
    return index_rule(c.node, c.name, c.states, c.rows)


def _same_tuple(out, s):
    return tuple(s for _ in out) if isinstance(out, (list, tuple)) else s


def _broadcast(node: fx.Node, states: dict):
    """Elementwise: rows map through right-aligned broadcasting; rows of two inputs meeting
    at different dims make every row meet every other (x[:, None] - x[None, :])."""
    out = node.meta.get("val")
    outs = out if isinstance(out, (list, tuple)) else [out]
    shape_o = tuple(int(s) for s in outs[0].shape) if isinstance(outs[0], torch.Tensor) else None
    found = set()
    for a in node.all_input_nodes:
        s, sh = states.get(a), shape_of(a)
        if s is None:
            continue
        if not isinstance(s, Rows) or sh is None or shape_o is None:
            return LOST, None
        d = s.dim + len(shape_o) - len(sh)
        if (d < 0 or d >= len(shape_o) or shape_o[d] != sh[s.dim]) and len(shape_o) > len(sh) \
                and shape_o[:s.dim + 1] == sh[:s.dim + 1]:
            d = s.dim   # an op that appends dims (one_hot): the leading dims stay
        if d < 0 or d >= len(shape_o) or shape_o[d] != sh[s.dim]:
            return LOST, None
        found.add(Rows(d, s.stride))
    if len({r.dim for r in found}) > 1:
        return LOST, "a product of every row with every other row"
    state = next(iter(found)) if found else None
    return _same_tuple(out, state), None


def _loss(node: fx.Node, states: dict):
    """A loss op: reduced (mean/sum) it mixes rows (the loss's final reduction, which
    loss_form combines exactly, is exempted by the caller); unreduced it is elementwise."""
    reduction = None
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == "reduction":
            reduction = arg_of(node, i, "reduction", a.default_value if a.has_default_value() else 1)
    if reduction == 0:
        s = [states.get(a) for a in node.args[:2] if isinstance(a, fx.Node)]
        rows = next((r for r in s if r is not None), None)
        return rows, None
    return LOST, "a reduction over the batch dim"


def _reduce(node: fx.Node, name: str, sx: Rows, shape_x: tuple):
    if name in ("max", "min", "median", "nanmedian") and len(node.args) < 2 and "dim" not in node.kwargs:
        return LOST, "a reduction over the batch dim"
    if name in ("norm", "linalg_vector_norm"):
        dim = arg_of(node, 2, "dim", None)
        keep = arg_of(node, 3, "keepdim", False)
    elif name == "count_nonzero":
        dim, keep = arg_of(node, 1, "dim", None), False
    else:
        dim = arg_of(node, 1, "dim", None)
        keep = arg_of(node, 2, "keepdim", False)
        if name in ("var", "std", "var_mean", "std_mean"):
            keep = node.kwargs.get("keepdim", keep if isinstance(keep, bool) else False)
    dims = dims_of(dim, len(shape_x))
    if sx.dim in dims:
        return LOST, "a reduction over the batch dim"
    d = sx.dim if keep else sx.dim - sum(1 for k in dims if k < sx.dim)
    out = node.meta.get("val")
    return _same_tuple(out, Rows(d, sx.stride)), None


def _matmul(node: fx.Node, name: str, states: dict):
    """a @ b (broadcast batch dims): rows in a's or b's contracted dim, or in a's rows and
    b's columns at once (a B x B similarity), make every output row depend on other rows."""
    args = node.args
    if name in ("addmm", "baddbmm", "addbmm"):
        a, b, bias = args[1], args[2], args[0]
    elif name == "linear":
        a, b, bias = args[0], args[1], (args[2] if len(args) > 2 else None)
    else:
        a, b, bias = args[0], args[1], None
    out = shape_of(node)
    sa, sb, sbias = rows_of(states, a), rows_of(states, b), rows_of(states, bias)
    sh_a, sh_b = shape_of(a), shape_of(b)
    if out is None or sh_a is None or sh_b is None:
        return LOST, None
    found = set()
    if sa is not None:
        if not isinstance(sa, Rows):
            return LOST, None
        if sa.dim == len(sh_a) - 1:
            return LOST, f"a {name} contracting the batch dim"
        found.add(len(out) - 1 - (len(sh_a) - 1 - sa.dim) if len(sh_a) > 1 else None)
    if sb is not None:
        if not isinstance(sb, Rows):
            return LOST, None
        nb = len(sh_b)
        if name == "linear":   # weight [out, in]: rows in `in` are contracted
            if sb.dim == nb - 1 or nb == 1:
                return LOST, f"a {name} contracting the batch dim"
            found.add(len(out) - 1)
        elif nb == 1 or sb.dim == nb - 2:
            return LOST, f"a {name} contracting the batch dim"
        else:
            found.add(len(out) - 1 - (nb - 1 - sb.dim))
    if sbias is not None:
        sh = shape_of(bias)
        if not isinstance(sbias, Rows) or sh is None:
            return LOST, None
        found.add(sbias.dim + len(out) - len(sh))
    if None in found:
        return LOST, None
    if len(found) > 1:
        return LOST, f"a {name} of every row with every other row"
    stride = next((s.stride for s in (sa, sb, sbias) if isinstance(s, Rows)), 1)
    return Rows(found.pop(), stride), None


def _einsum(node: fx.Node, states: dict):
    eq, ops = node.args[0], node.args[1]
    # '...' as letters of their own (needs the operands' ranks; -1: not known)
    eq = explicit_einsum(eq, [len(s) if s is not None else -1 for s in map(shape_of, ops)])
    if eq is None:
        return LOST, None
    lhs, rhs = eq.split("->")
    found = set()
    for term, a in zip(lhs.split(","), ops):
        s = rows_of(states, a)
        if s is None:
            continue
        if not isinstance(s, Rows):
            return LOST, None
        letter = term[s.dim]
        if letter not in rhs:
            return LOST, "an einsum contracting the batch dim"
        found.add(letter)
    if len(found) > 1:
        return LOST, "an einsum of every row with every other row"
    letter = found.pop()
    return Rows(rhs.index(letter)), None


def _sdpa(node: fx.Node, states: dict):
    q, k, v = node.args[:3]
    mask = arg_of(node, 3, "attn_mask", None)
    out = node.meta.get("val")
    shape_o = shape_of(q)
    found = set()
    for a, key in ((q, False), (k, True), (v, True), (mask, None)):
        s = rows_of(states, a)
        if s is None:
            continue
        sh = shape_of(a)
        if not isinstance(s, Rows) or sh is None or shape_o is None:
            return LOST, None
        from_end = len(sh) - 1 - s.dim
        if from_end == 0 or (key and from_end == 1):
            return LOST, "attention across the batch dim"
        found.add(len(shape_o) - 1 - from_end)
    if len(found) > 1:
        return LOST, "attention of every row with every other row"
    state = Rows(found.pop()) if found else None
    return _same_tuple(out, state), None


@ROWS.rule(*fam.ROW_VIEWS)
def _view_rule(c: RowCall):
    return _view(c.node, c.name, c.sx, c.shape_x, c.rows)


def _view(node: fx.Node, name: str, sx, shape_x, rows: int):
    out = shape_of(node)
    if sx is None:
        return None, None
    if sx == POS:
        return POS, None
    if out is None or shape_x is None:
        return LOST, None
    d = sx.dim
    if name in fam.COPIES:
        return sx, None
    if name in ("transpose", "swapaxes"):
        a, b = (arg_of(node, 1, "dim0") % len(shape_x), arg_of(node, 2, "dim1") % len(shape_x))
        return Rows(b if d == a else a if d == b else d, sx.stride), None
    if name in ("t", "numpy_T"):
        return Rows(len(shape_x) - 1 - d, sx.stride), None
    if name == "permute":
        perm = [p % len(shape_x) for p in node.args[1]]
        return Rows(perm.index(d), sx.stride), None
    if name == "movedim":
        src, dst = node.args[1], node.args[2]
        src = [s % len(shape_x) for s in (src if isinstance(src, (list, tuple)) else [src])]
        dst = [s % len(out) for s in (dst if isinstance(dst, (list, tuple)) else [dst])]
        order = [None] * len(out)
        for s_, t_ in zip(src, dst):
            order[t_] = s_
        rest = iter(i for i in range(len(shape_x)) if i not in src)
        order = [o if o is not None else next(rest) for o in order]
        return Rows(order.index(d), sx.stride), None
    if name in ("select",):
        dim = arg_of(node, 1, "dim") % len(shape_x)
        if dim == d:
            return LOST, "a pick of one row of the batch by position"
        return Rows(d - (dim < d), sx.stride), None
    if name in ("slice", "narrow"):
        dim = arg_of(node, 1, "dim", 0) % len(shape_x)
        if dim == d and out[d] != shape_x[d]:
            return LOST, "a pick of some rows of the batch by position"
        return sx, None
    if name in ("expand", "expand_as", "repeat"):
        d2 = d + len(out) - len(shape_x)
        if out[d2] != shape_x[d]:
            return LOST, "a repeat of the batch rows"
        return Rows(d2, sx.stride), None
    if name in ("diagonal", "unfold", "as_strided", "pixel_shuffle"):
        return (sx, None) if out[:d + 1] == shape_x[:d + 1] else (LOST, None)
    return _reshape(sx, shape_x, out, rows)


def _reshape(sx: Rows, shape_x: tuple, out: tuple, rows: int):
    """Where the batch factor (rows of stride sx.stride inside dim sx.dim) lands when the
    same elements are read with shape `out`: the output dim whose extent holds it whole."""
    after = 1
    for s in shape_x[sx.dim + 1:]:
        after *= s
    step = max(sx.stride, 1) * after              # element stride of one row
    n = rows if shape_x[sx.dim] % (rows * sx.stride) == 0 else shape_x[sx.dim] // sx.stride
    if out[:sx.dim + 1] == shape_x[:sx.dim + 1]:   # the dims up to the rows' are unchanged
        return sx, None
    fits = []
    for k in range(len(out)):
        stride_k = 1
        for s in out[k + 1:]:
            stride_k *= s
        span = stride_k * out[k]
        if step % stride_k == 0 and step * n <= span and span % (step * n) == 0:
            fits.append((k, stride_k, span))
    # with more than one row the factor fits exactly one dim; a factor of length 1 (one row
    # per microbatch) also sits at a dim boundary, as the inner part of one dim or the outer
    # part of the next ([T, 1, C] -> [T, C]): then only an unambiguous place is taken
    places = {k for k, st, span in fits if (st == step and out[k] == n) or span == step * n
              or st <= step < span}
    if len(places) == 1:
        k = places.pop()
        stride_k = next(st for kk, st, _ in fits if kk == k)
        return Rows(k, step // stride_k), None
    return LOST, None


def _cat(node: fx.Node, name: str, states: dict):
    tensors = node.args[0]
    dim = arg_of(node, 1, "dim", 0)
    out = shape_of(node)
    found = set()
    for a in tensors:
        s = rows_of(states, a)
        if s is None:
            continue
        sh = shape_of(a)
        if not isinstance(s, Rows) or sh is None or out is None:
            return LOST, None
        dd = dim % (len(sh) + (name == "stack"))
        if name == "cat" or name in ("concat", "concatenate"):
            if s.dim == dd:
                return LOST, "a concatenation along the batch dim"
            found.add(Rows(s.dim, s.stride))
        else:
            found.add(Rows(s.dim + (s.dim >= dd), s.stride))
    if len({f.dim for f in found}) > 1:
        return LOST, None
    return (found.pop() if found else None), None
