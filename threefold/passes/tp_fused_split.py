"""Fused projections whose output is cut into pieces by slices, constant indices or a split
(Falcon's multi-query query_key_value: [.., heads + 2, head_dim], queries = x[..., :-2, :],
key = x[..., [-2], :], value = x[..., [-1], :], or since transformers 5.25
`x.split([heads, 1, 1], dim=-2)`) become one linear per piece, on a piece of the weight:
`split_with_sizes(W, rows, 0)[i]`.

Then each piece is its own projection to the tensor-parallel pass (tp_pieces.py): the
queries, whose heads tp divides, are column-parallel, while the single key/value head is
kept whole on every rank, in one parameter whose ShardSpec says which blocks are whole.
The rewrite only changes how the same numbers are computed (each output row is the same
dot product), and runs on a copy of the traced graph, for tp > 1 only.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.passes.tp_patterns import _is_param, _param_weight
from threefold.ops.families import RESHAPES

aten = torch.ops.aten
_VIEWS = RESHAPES


def fused_cuts(graph: fx.Graph, state: dict) -> list[tuple]:
    """(matmul, x, weight, bias, view or None, [(reader, start, stop)]) for every weight
    matmul whose output (or its [.., n, d] view) is read only by pieces that cut the
    split dim into consecutive ranges."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        w = _param_weight(node, op_name(node))
        if w is None:
            continue
        x, weight, bias, out_dim = w
        shape = weight.meta.get("val").shape if isinstance(weight.meta.get("val"), torch.Tensor) else ()
        if out_dim != 0 or len(shape) != 2 or len(node.users) != 1:
            continue
        (user,) = node.users
        view, dim, size = None, -1, int(shape[0])
        if op_name(user) in _VIEWS:
            vshape = list(user.meta["val"].shape)
            if len(vshape) < 2 or vshape[-2] * vshape[-1] != size:
                continue
            view, dim, size = user, -2, vshape[-2]
        readers = _ranges(view or node, dim, size, state)
        if readers:
            out.append((node, x, weight, bias, view, readers))
    return out


def _ranges(src: fx.Node, dim: int, size: int, state: dict):
    ndim = src.meta["val"].dim()
    d = dim % ndim
    readers = []
    for r in src.users:
        pieces = _split_pieces(r, d, ndim)
        if pieces is not None:
            readers.extend(pieces)
            continue
        rng = _range_of(r, d, ndim, size, state)
        if rng is None:
            return None
        readers.append((r, *rng))
    readers.sort(key=lambda t: t[1])
    pos = 0
    for _, start, stop in readers:
        if start != pos or stop <= start:
            return None      # overlapping or leaving rows unread: not a partition
        pos = stop
    return readers if pos == size and len(readers) > 1 else None


def _split_pieces(r: fx.Node, d: int, ndim: int):
    """[(getitem, start, stop)] when `r` splits dim d into sizes and every piece is read
    through a getitem; None otherwise."""
    if r.op != "call_function" or op_name(r) not in ("split_with_sizes", "split"):
        return None
    norm = normalize_function(r.target, tuple(r.args), dict(r.kwargs), normalize_to_only_use_kwargs=True)
    kwargs = norm.kwargs if norm is not None else None
    if not kwargs:
        return None
    sizes, dim = kwargs.get("split_sizes", kwargs.get("split_size")), kwargs.get("dim", 0)
    if not isinstance(sizes, (list, tuple)) or dim % ndim != d:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = []
    for g in r.users:
        if g.target is not operator.getitem or not isinstance(g.args[1], int):
            return None
        i = g.args[1]
        pieces.append((g, starts[i], starts[i] + int(sizes[i])))
    return pieces if len({i for _, i, _ in pieces}) == len(sizes) else None


def _range_of(r: fx.Node, d: int, ndim: int, size: int, state: dict):
    name = op_name(r)
    if name == "slice" and r.args[0] is not None:
        args = list(r.args) + [None] * (5 - len(r.args))
        dim, start, stop, step = (args[1] if args[1] is not None else 0), args[2], args[3], args[4]
        if dim % ndim != d or step not in (None, 1):
            return None
        start, stop, _ = slice(start, stop).indices(size)
        return start, stop
    if name == "index" and len(r.args) == 2:
        idx = list(r.args[1])
        if len(idx) != d + 1 or any(i is not None for i in idx[:-1]):
            return None
        value = _constant(idx[-1], state)
        if value is None or value.numel() != 1 or value.dim() != 1:
            return None
        i = int(value.item()) % size
        return i, i + 1
    return None


def _constant(node, state: dict):
    """The value of a lifted constant index (lift_fresh_copy of a `_const` buffer)."""
    if isinstance(node, fx.Node) and op_name(node) == "lift_fresh_copy":
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "placeholder" and tf(node).get("kind") == "buffer":
        v = state.get(tf(node).get("fqn"))
        if isinstance(v, torch.Tensor) and not v.dtype.is_floating_point:
            return v
    return None


def split_fused_outputs(graph: fx.Graph, state: dict) -> int:
    """Rewrite every fused_cuts match into per-piece linears; how many were rewritten."""
    cuts = fused_cuts(graph, state)
    for node, x, weight, bias, view, readers in cuts:
        per_row = 1 if view is None else int(view.meta["val"].shape[-1])
        rows = [(stop - start) * per_row for _, start, stop in readers]
        meta = dict(node.meta)
        with graph.inserting_before(node):
            w_split = _call(graph, aten.split_with_sizes.default, (weight, rows, 0), meta,
                            [_meta(weight, 0, r) for r in rows])
            b_split = None if bias is None else _call(graph, aten.split_with_sizes.default, (bias, rows, 0), meta,
                                                      [_meta(bias, 0, r) for r in rows])
            # every piece first (the tp pass reads a split's pieces together), then the linears
            ws = [_call(graph, operator.getitem, (w_split, i), meta, w_split.meta["val"][i]) for i in range(len(rows))]
            bs = [None if b_split is None else _call(graph, operator.getitem, (b_split, i), meta,
                                                     b_split.meta["val"][i]) for i in range(len(rows))]
            for i, (reader, start, stop) in enumerate(readers):
                args = [x, ws[i]] + ([bs[i]] if bs[i] is not None else [])
                lin_val = _meta(node, -1, rows[i])
                piece = _call(graph, aten.linear.default, tuple(args), meta, lin_val)
                if view is not None:
                    shape = list(view.meta["val"].shape)
                    shape[-2] = stop - start
                    piece = _call(graph, aten.reshape.default, (piece, shape), dict(view.meta),
                                  _meta(view, -2, stop - start))
                reader.replace_all_uses_with(piece)
        splits = {r.args[0] for r, _, _ in readers if r.target is operator.getitem}
        for reader, _, _ in readers:
            graph.erase_node(reader)
        for split in splits:      # a split whose pieces were all replaced
            graph.erase_node(split)
        if view is not None:
            graph.erase_node(view)
        transposed = [a for a in node.all_input_nodes if a is not x and not _is_param(a)]
        graph.erase_node(node)
        for t in transposed:      # W.T read by the fused matmul only
            if not t.users:
                graph.erase_node(t)
    return len(cuts)


def _call(graph: fx.Graph, target, args, meta: dict, val) -> fx.Node:
    n = graph.call_function(target, args)
    n.meta = {k: v for k, v in meta.items() if k in ("nn_module_stack", "stack_trace")}
    n.meta["val"] = val
    n.meta["tf"] = {k: v for k, v in tf_of(meta).items() if k == "module"}
    return n


def tf_of(meta: dict) -> dict:
    return meta.get("tf") or {}


def _meta(node: fx.Node, dim: int, size: int) -> torch.Tensor:
    v = node.meta["val"]
    shape = list(v.shape)
    shape[dim] = size
    return torch.empty(shape, dtype=v.dtype, device="meta")
