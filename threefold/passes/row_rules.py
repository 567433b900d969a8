"""Per-op rules: where the rows of the batch go through an ATen op, and which ops mix them.

A value's row state is one of
  None          it does not depend on the split inputs (parameters, constants, unsplit inputs)
  Rows(d, s)    row i of the batch lives at index i*s.. of dim d (s: the stride of the batch
                factor inside that dim, >1 after a view merged dims after it, e.g. [B*T, C])
  LOST          it depends on the batch but no rule says where the rows are (an op without
                a rule whose output keeps no dim of the rows' length); nothing after is checked
  POS           a tensor of row positions (nonzero/where over a per-row mask): indexing the
                rows with it selects a subset of rows in order, which is per-row
and a tuple of states for an op with several outputs.

`propagate(node, states, rows)` returns (state of the node, reason): the reason is a short
phrase when the op makes an output row depend on other rows (a reduction, scan, sort or
contraction over the batch dim, an all-pairs product, a pick of rows by position or value,
a batch statistic), else None. Ops are keyed by their ATen schema name, grouped by family;
an op without a rule maps rows through broadcasting (right-aligned dims of equal length),
which is what elementwise ops do.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class Rows:
    dim: int
    stride: int = 0   # 0: not known yet; propagate() makes it the dim's outer factor


LOST = "lost"
POS = "positions"

# op -> index of its `training` argument (-1: always training)
BATCH_STAT_OPS = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                  "_native_batch_norm_legit_functional": 5, "cudnn_batch_norm": 5,
                  "miopen_batch_norm": 5, "_batch_norm_impl_index": 5,
                  "_batch_norm_with_update": -1, "_batch_norm_with_update_functional": -1}
_NO_STAT_NORMS = {"_native_batch_norm_legit_no_training", "_batch_norm_no_update"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean",
               "logsumexp", "norm", "linalg_vector_norm", "all", "any", "count_nonzero", "max",
               "min", "argmax", "argmin", "nansum", "nanmean", "aminmax", "median", "nanmedian"}
_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax", "_softmax",
          "log_softmax", "_log_softmax", "sort", "argsort", "topk", "kthvalue", "mode",
          "_safe_softmax", "glu", "flip", "roll"}
_MATMULS = {"mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "dot", "mv", "vdot"}
_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss",
           "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
           "soft_margin_loss", "kl_div", "hinge_embedding_loss", "margin_ranking_loss",
           "poisson_nll_loss", "cosine_embedding_loss", "multilabel_margin_loss", "multi_margin_loss"}
_GROUPED_MM = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}
_POS_ARITH = {"floor_divide", "div", "remainder", "add", "sub", "mul", "fmod"}
_CONVS = {"convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
          "conv_transpose3d", "_convolution"}


def op_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        return "getitem"
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else getattr(node.target, "__name__", "")


def _shape(a) -> tuple | None:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    if isinstance(v, torch.Tensor):
        try:
            return tuple(int(s) for s in v.shape)
        except Exception:  # a symbolic size: no rule can place rows in it
            return None
    return None


def _arg(node: fx.Node, i: int, name: str, default=None):
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def _dims(dim, ndim: int) -> list[int]:
    if dim is None:
        return list(range(ndim))
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if not dims:  # sum(x, []) reduces every dim
        return list(range(ndim))
    return [d % max(ndim, 1) for d in dims]


def _rows_of(states: dict, a):
    return states.get(a) if isinstance(a, fx.Node) else None


def propagate(node: fx.Node, states: dict, rows: int):
    """(row state of node's output, reason it mixes rows or None)."""
    state, reason = _propagate(node, states, rows)
    shape = _shape(node)
    if isinstance(state, Rows) and state.stride == 0:
        # rows found without a stride (a rule that saw a whole dim): the batch factor is
        # the dim's outer factor ([B*T] after an index by positions)
        ok = shape and state.dim < len(shape) and rows and shape[state.dim] % rows == 0
        state = Rows(state.dim, shape[state.dim] // rows if ok else 1)
    return state, reason


def _propagate(node: fx.Node, states: dict, rows: int):
    name = op_name(node)
    ins = {a: states.get(a) for a in node.all_input_nodes}
    if all(s is None for s in ins.values()):
        return None, None
    if name in _GROUPED_MM:
        # rows sorted by group, each multiplied by its own group's weight: per row (the
        # offsets, counted over all rows, only say where each group's rows start)
        sx, sw = states.get(node.args[0]), states.get(node.args[1])
        return (sx, None) if sw is None and isinstance(sx, Rows) and sx.dim == 0 else (LOST, None)
    if name in ("empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros",
                "new_ones", "new_full", "scalar_tensor"):
        return None, None   # only the shape is read, which every microbatch has alike
    if node.meta.get("val") is None and not node.users:
        return None, None   # no value (an assertion on metadata)
    if any(s == LOST for s in ins.values()):
        return LOST, None
    if name == "getitem":
        s = states.get(node.args[0])
        return (s[node.args[1]] if isinstance(s, tuple) and node.args[1] < len(s) else s), None
    x = node.args[0] if node.args else None
    sx = _rows_of(states, x)
    shape_x, out = _shape(x), node.meta.get("val")
    if name in BATCH_STAT_OPS:
        idx = BATCH_STAT_OPS[name]
        training = True if idx < 0 else _arg(node, idx, "training", False)
        if training and isinstance(sx, Rows) and sx.dim == 0:
            return _same_tuple(out, sx), "batch statistics"
        if training:
            return LOST, "batch statistics"
        return _same_tuple(out, sx), None
    if name in _NO_STAT_NORMS:
        return _same_tuple(out, sx), None
    if sx == POS and name not in ("index", "index_put", "index_put_", "index_add", "index_add_",
                                  "index_copy", "index_copy_", "index_select", "_unsafe_index"):
        if name in _POS_ARITH and all(states.get(a) is None for a in node.all_input_nodes if a is not x):
            return POS, None   # perm // k: positions of the rows the (row, k) pairs came from
        return (POS, None) if name in _VIEWLIKE else (LOST, None)
    if name in _LOSSES:
        return _loss(node, states)
    if name in _REDUCTIONS and isinstance(sx, Rows) and isinstance(x, fx.Node) \
            and isinstance(x.meta.get("val"), torch.Tensor):
        return _reduce(node, name, sx, tuple(x.meta["val"].shape))   # only its rank is read
    if name in ("sort", "argsort") and isinstance(sx, Rows) and shape_x:
        dim = _arg(node, 1, "dim", -1)
        if isinstance(dim, int) and dim % len(shape_x) == sx.dim:
            # a permutation of the rows: the values are the rows in another order, the
            # indices their positions (indexing rows with them, and back, stays per-row)
            return ((Rows(sx.dim), POS) if name == "sort" else POS), None
    if name in _SCANS and isinstance(sx, Rows):
        dim = _arg(node, 1, "dim", -1)
        if name in ("topk", "kthvalue"):
            dim = _arg(node, 2, "dim", -1)
        if name in ("flip", "roll"):
            dims = _arg(node, 1, "dims") if name == "flip" else _arg(node, 2, "dims", None)
            hit = dims is None or sx.dim in _dims(dims, len(shape_x or ()))
            return _same_tuple(out, sx), (f"{name} over the batch dim" if hit else None)
        if isinstance(dim, int) and shape_x and dim % len(shape_x) == sx.dim:
            return _same_tuple(out, sx), f"{name} over the batch dim"
        return _same_tuple(out, sx), None
    if name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"):
        norm = _arg(node, 1, "normalized_shape", ())
        if isinstance(sx, Rows) and shape_x and sx.dim >= len(shape_x) - len(norm):
            return _same_tuple(out, sx), "a normalisation over the batch dim"
        return _same_tuple(out, sx), None
    if name in ("group_norm", "native_group_norm", "instance_norm"):
        if isinstance(sx, Rows) and sx.dim != 0:
            return _same_tuple(out, sx), "a normalisation over the batch dim"
        return _same_tuple(out, sx), None
    if name in _MATMULS:
        return _matmul(node, name, states)
    if name == "einsum":
        return _einsum(node, states)
    if name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"):
        return _sdpa(node, states)
    if name in _CONVS:
        sw = _rows_of(states, node.args[1] if len(node.args) > 1 else None)
        if sw is not None or not (sx is None or isinstance(sx, Rows) and sx.dim == 0):
            return LOST, "a convolution over the batch dim"
        return sx, None
    if name == "embedding":
        sw, si = sx, _rows_of(states, node.args[1])
        if sw is not None:
            return LOST, "a lookup in a table built from the batch"
        return si, None
    if name in _VIEWLIKE:
        return _view(node, name, sx, shape_x, rows)
    if name in ("cat", "concat", "concatenate", "stack"):
        return _cat(node, name, states)
    if name in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split",
                "split_copy"):
        dim = _arg(node, 1 if name == "unbind" else 2, "dim", 0)
        if isinstance(sx, Rows) and shape_x and dim % len(shape_x) == sx.dim:
            return LOST, f"{name} of the batch into parts by position"
        n = len(out) if isinstance(out, (list, tuple)) else 1
        if name == "unbind" and isinstance(sx, Rows) and sx.dim > dim % len(shape_x):
            return tuple(Rows(sx.dim - 1, sx.stride) for _ in range(n)), None
        return tuple(sx for _ in range(n)), None
    if name in ("nonzero", "argwhere"):
        return POS, None
    if name in ("index", "_unsafe_index"):
        return _index(node, states, rows)
    if name in ("index_select",):
        return _index_select(node, states, rows)
    if name in ("gather", "take_along_dim"):
        return _gather(node, states)
    if name in ("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_",
                "index_fill", "index_fill_", "index_reduce", "index_reduce_"):
        return _scatter(node, name, states, rows)
    if name in ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"):
        return _index_put(node, states, rows)
    return _broadcast(node, states)


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
        s, sh = states.get(a), _shape(a)
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
            reduction = _arg(node, i, "reduction", a.default_value if a.has_default_value() else 1)
    if reduction == 0:
        s = [states.get(a) for a in node.args[:2] if isinstance(a, fx.Node)]
        rows = next((r for r in s if r is not None), None)
        return rows, None
    return LOST, "a reduction over the batch dim"


def _reduce(node: fx.Node, name: str, sx: Rows, shape_x: tuple):
    if name in ("max", "min", "median", "nanmedian") and len(node.args) < 2 and "dim" not in node.kwargs:
        return LOST, "a reduction over the batch dim"
    if name in ("norm", "linalg_vector_norm"):
        dim = _arg(node, 2, "dim", None)
        keep = _arg(node, 3, "keepdim", False)
    elif name == "count_nonzero":
        dim, keep = _arg(node, 1, "dim", None), False
    else:
        dim = _arg(node, 1, "dim", None)
        keep = _arg(node, 2, "keepdim", False)
        if name in ("var", "std", "var_mean", "std_mean"):
            keep = node.kwargs.get("keepdim", keep if isinstance(keep, bool) else False)
    dims = _dims(dim, len(shape_x))
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
    out = _shape(node)
    sa, sb, sbias = _rows_of(states, a), _rows_of(states, b), _rows_of(states, bias)
    sh_a, sh_b = _shape(a), _shape(b)
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
        sh = _shape(bias)
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
    if "..." in eq or "->" not in eq:
        return LOST, None
    lhs, rhs = eq.replace(" ", "").split("->")
    found = set()
    for term, a in zip(lhs.split(","), ops):
        s = _rows_of(states, a)
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
    mask = _arg(node, 3, "attn_mask", None)
    out = node.meta.get("val")
    shape_o = _shape(q)
    found = set()
    for a, key in ((q, False), (k, True), (v, True), (mask, None)):
        s = _rows_of(states, a)
        if s is None:
            continue
        sh = _shape(a)
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


_VIEWLIKE = {"view", "_unsafe_view", "reshape", "flatten", "unflatten", "view_as", "reshape_as",
             "transpose", "t", "permute", "movedim", "swapaxes", "unsqueeze", "squeeze", "select",
             "slice", "narrow", "expand", "expand_as", "repeat", "alias", "detach", "clone",
             "contiguous", "_to_copy", "to", "lift_fresh_copy", "view_copy", "numpy_T",
             "diagonal", "unfold", "as_strided", "type_as", "pixel_shuffle"}


def _view(node: fx.Node, name: str, sx, shape_x, rows: int):
    out = _shape(node)
    if sx is None:
        return None, None
    if sx == POS:
        return POS, None
    if out is None or shape_x is None:
        return LOST, None
    d = sx.dim
    if name in ("alias", "detach", "clone", "contiguous", "_to_copy", "to", "lift_fresh_copy", "type_as"):
        return sx, None
    if name in ("transpose", "swapaxes"):
        a, b = (_arg(node, 1, "dim0") % len(shape_x), _arg(node, 2, "dim1") % len(shape_x))
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
        dim = _arg(node, 1, "dim") % len(shape_x)
        if dim == d:
            return LOST, "a pick of one row of the batch by position"
        return Rows(d - (dim < d), sx.stride), None
    if name in ("slice", "narrow"):
        dim = _arg(node, 1, "dim", 0) % len(shape_x)
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
    dim = _arg(node, 1, "dim", 0)
    out = _shape(node)
    found = set()
    for a in tensors:
        s = _rows_of(states, a)
        if s is None:
            continue
        sh = _shape(a)
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


def _is_iota(node, n: int) -> bool:
    """Is `node` arange(n) (through casts and size-1 views): the rows' own positions?"""
    while isinstance(node, fx.Node) and op_name(node) in ("unsqueeze", "view", "reshape", "_to_copy",
                                                         "to", "expand", "clone", "alias", "detach"):
        node = node.args[0]
    if not isinstance(node, fx.Node) or op_name(node) != "arange":
        return False
    sh = _shape(node)
    return sh == (n,) and (len(node.args) == 1 or node.args[0] == 0) and \
        (len(node.args) < 3 or node.args[2] == 1)


def _index(node: fx.Node, states: dict, rows: int):
    """x[i0, i1, ...] (advanced indexing): the index tensors broadcast to one block that
    replaces the indexed dims (at the first one when they are adjacent, else in front)."""
    x, indices = node.args[0], list(node.args[1])
    sx, sh = _rows_of(states, x), _shape(x)
    if sh is None or not isinstance(node.meta.get("val"), torch.Tensor):   # the output may be
        return LOST, None                                                  # data-dependent (x[mask])
    pos = [i for i, t in enumerate(indices) if t is not None]
    block = [_shape(indices[i]) or () for i in pos]
    bools = [i for i in pos if getattr(indices[i].meta.get("val"), "dtype", None) == torch.bool]
    if bools:  # a boolean mask picks elements in order: rows stay rows when the mask is per-row
        return _mask_index(node, states, sx, sh, pos, indices)
    nb = max((len(b) for b in block), default=0)
    start = pos[0] if pos == list(range(pos[0], pos[-1] + 1)) else 0
    found = set()
    if isinstance(sx, Rows):
        if sx.dim in pos:
            idx = indices[sx.dim]
            s_i = _rows_of(states, idx)
            if _is_iota(idx, sh[sx.dim]) or s_i == POS:
                isz = _shape(idx) or ()
                sizes = [k for k, s in enumerate(isz) if s != 1]
                k = sizes[0] if len(sizes) == 1 else (0 if s_i == POS else None)
                if k is None:
                    return LOST, None
                found.add(start + nb - len(isz) + k)
            else:
                return LOST, "an index that picks rows of the batch by value"
        else:
            adjacent = pos == list(range(pos[0], pos[-1] + 1))
            if not adjacent:
                d = nb + sx.dim - sum(1 for i in pos if i < sx.dim)
            elif sx.dim < pos[0]:
                d = sx.dim
            else:
                d = sx.dim - len(pos) + nb
            found.add(d)
    elif sx is not None:
        return LOST, None
    for i in pos:
        s = _rows_of(states, indices[i])
        if s is None or i == getattr(sx, "dim", None):
            continue
        if s == POS:
            return LOST, "an index by row positions into a dim that is not the batch"
        if not isinstance(s, Rows):
            return LOST, None
        isz = _shape(indices[i]) or ()
        found.add(start + nb - len(isz) + s.dim)
    if len(found) > 1:
        return LOST, "an index that pairs every row with every other row"
    return (Rows(found.pop()) if found else None), None


def _mask_index(node, states, sx, sh, pos, indices):
    """x[mask]: the elements where the mask holds, in order, replace the masked dims."""
    if len(pos) != 1:
        return LOST, None
    mask = indices[pos[0]]
    sm, nd = _rows_of(states, mask), len(_shape(mask) or ())
    if sx is None:
        return (Rows(pos[0]) if isinstance(sm, Rows) else None if sm is None else LOST), None
    if not isinstance(sx, Rows):
        return LOST, None
    if pos[0] <= sx.dim < pos[0] + nd:
        if isinstance(sm, Rows) and sm.dim == sx.dim - pos[0]:
            return Rows(pos[0]), None   # a per-row mask: each row's picks, rows in order
        return LOST, "a boolean index that picks rows of the batch by position or by other rows"
    if sm is not None:
        return LOST, None
    return Rows(sx.dim if sx.dim < pos[0] else sx.dim - nd + 1, sx.stride), None


def _index_select(node: fx.Node, states: dict, rows: int):
    x, dim, idx = node.args[:3]
    sx, si, sh = _rows_of(states, x), _rows_of(states, idx), _shape(x)
    if sh is None:
        return LOST, None
    dim %= len(sh)
    if isinstance(sx, Rows) and sx.dim == dim:
        if _is_iota(idx, sh[dim]) or si == POS:
            return sx, None
        return LOST, "an index_select that picks rows of the batch by value"
    if si is not None:
        if sx is not None or not isinstance(si, Rows):
            return LOST, "an index_select that pairs rows with other rows" if sx is not None else None
        return Rows(dim), None
    return sx, None


def _gather(node: fx.Node, states: dict):
    x, dim, idx = node.args[:3]
    sx, si, sh = _rows_of(states, x), _rows_of(states, idx), _shape(x)
    if sh is None:
        return LOST, None
    dim %= len(sh)
    if isinstance(sx, Rows) and sx.dim == dim:
        return LOST, "a gather along the batch dim"
    found = {s.dim for s in (sx, si) if isinstance(s, Rows)}
    if any(s is not None and not isinstance(s, Rows) for s in (sx, si)):
        return LOST, None
    if len(found) > 1:
        return LOST, "a gather that pairs rows with other rows"
    return Rows(found.pop()), None


def _scatter(node: fx.Node, name: str, states: dict, rows: int):
    x, dim = node.args[0], node.args[1]
    rest = [a for a in node.args[2:] if isinstance(a, fx.Node)]
    idx = node.args[2] if len(node.args) > 2 else None
    sx, sh = _rows_of(states, x), _shape(x)
    if sh is None:
        return LOST, None
    dim %= len(sh)
    states_in = [sx] + [_rows_of(states, a) for a in rest]
    if name.startswith("index_"):
        si = _rows_of(states, idx)
        src = [_rows_of(states, a) for a in rest[1:]]
        if si == POS or (isinstance(idx, fx.Node) and _is_iota(idx, sh[dim])):
            # written back at the positions the rows were taken from: per-row
            found = {s.dim for s in [sx] + src if isinstance(s, Rows)}
            return (Rows(dim) if found <= {dim} and (found or si == POS) else LOST), \
                (None if found <= {dim} else "an index write that pairs rows with other rows")
        if si is not None or (isinstance(sx, Rows) and sx.dim == dim) or any(
                isinstance(s, Rows) and s.dim == dim for s in src):
            return LOST, f"an {name} that writes rows of the batch by value"
        states_in = [sx] + src
    elif any(isinstance(s, Rows) and s.dim == dim for s in states_in):
        return LOST, f"a {name} along the batch dim"
    if any(s is not None and not isinstance(s, Rows) for s in states_in):
        return LOST, None
    found = {s.dim for s in states_in if isinstance(s, Rows)}
    if len(found) > 1:
        return LOST, f"a {name} that pairs rows with other rows"
    return (Rows(found.pop()) if found else None), None


def _index_put(node: fx.Node, states: dict, rows: int):
    x, indices, values = node.args[0], list(node.args[1]), node.args[2]
    sx, sh = _rows_of(states, x), _shape(x)
    if sh is None:
        return LOST, None
    pos = [i for i, t in enumerate(indices) if t is not None]
    sv = _rows_of(states, values)
    bools = [i for i in pos if getattr(indices[i].meta.get("val"), "dtype", None) == torch.bool]
    if bools and len(pos) == 1:
        sm = _rows_of(states, indices[pos[0]])
        if sm is None and sv is None:
            return sx, None
        if isinstance(sx, Rows) and isinstance(sm, Rows) and sm.dim == sx.dim - pos[0] and sv is None:
            return sx, None    # x[mask] = constant, the mask per row: an elementwise write
        if sx is None and isinstance(sm, Rows) and sv is None:
            return Rows(sm.dim + pos[0]), None
        return LOST, "a masked write that moves values between rows"
    if len(pos) == 1 and _rows_of(states, indices[pos[0]]) == POS and _is_iota(values, sh[pos[0]]) \
            and len(sh) == 1:
        return POS, None   # inv[perm] = arange(n): the inverse permutation, positions again
    if isinstance(sx, Rows) and sx.dim in pos:
        idx = indices[sx.dim]
        if not (_is_iota(idx, sh[sx.dim]) or _rows_of(states, idx) == POS):
            return LOST, "an index_put that writes rows of the batch by position or value"
        return sx, None
    if any(_rows_of(states, indices[i]) is not None for i in pos):
        return LOST, "an index_put whose index depends on the batch"
    if sv is not None and sx is None:
        return LOST, None
    return sx, None
