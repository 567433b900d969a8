"""Row rules for indexing ops: index, index_select, gather, scatter, index_put, masks.

An index along the batch dim keeps rows per-row only when it is the rows' own positions
(arange over the dim, or positions from nonzero/argsort); by any other value (x[0],
x[labels]) it picks rows of other samples and mixes them. See passes/row_rules.py.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.passes.row_state import LOST, POS, Rows, op_name, rows_of, shape_of
from threefold.ops.families import INDEXING, SIZE_ONE_VIEWS


def is_iota(node, n: int) -> bool:
    """Is `node` arange(n) (through casts and size-1 views): the rows' own positions?"""
    while isinstance(node, fx.Node) and op_name(node) in SIZE_ONE_VIEWS:
        node = node.args[0]
    if not isinstance(node, fx.Node) or op_name(node) != "arange":
        return False
    sh = shape_of(node)
    return sh == (n,) and (len(node.args) == 1 or node.args[0] == 0) and \
        (len(node.args) < 3 or node.args[2] == 1)


def _index(node: fx.Node, states: dict, rows: int):
    """x[i0, i1, ...] (advanced indexing): the index tensors broadcast to one block that
    replaces the indexed dims (at the first one when they are adjacent, else in front)."""
    x, indices = node.args[0], list(node.args[1])
    sx, sh = rows_of(states, x), shape_of(x)
    if sh is None or not isinstance(node.meta.get("val"), torch.Tensor):   # the output may be
        return LOST, None                                                  # data-dependent (x[mask])
    pos = [i for i, t in enumerate(indices) if t is not None]
    block = [shape_of(indices[i]) or () for i in pos]
    bools = [i for i in pos if getattr(indices[i].meta.get("val"), "dtype", None) == torch.bool]
    if bools:  # a boolean mask picks elements in order: rows stay rows when the mask is per-row
        return _mask_index(node, states, sx, sh, pos, indices)
    nb = max((len(b) for b in block), default=0)
    start = pos[0] if pos == list(range(pos[0], pos[-1] + 1)) else 0
    found = set()
    if isinstance(sx, Rows):
        if sx.dim in pos:
            idx = indices[sx.dim]
            s_i = rows_of(states, idx)
            if is_iota(idx, sh[sx.dim]) or s_i == POS:
                isz = shape_of(idx) or ()
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
        s = rows_of(states, indices[i])
        if s is None or i == getattr(sx, "dim", None):
            continue
        if s == POS:
            return LOST, "an index by row positions into a dim that is not the batch"
        if not isinstance(s, Rows):
            return LOST, None
        isz = shape_of(indices[i]) or ()
        found.add(start + nb - len(isz) + s.dim)
    if len(found) > 1:
        return LOST, "an index that pairs every row with every other row"
    return (Rows(found.pop()) if found else None), None


def _mask_index(node, states, sx, sh, pos, indices):
    """x[mask]: the elements where the mask holds, in order, replace the masked dims."""
    if len(pos) != 1:
        return LOST, None
    mask = indices[pos[0]]
    sm, nd = rows_of(states, mask), len(shape_of(mask) or ())
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
    sx, si, sh = rows_of(states, x), rows_of(states, idx), shape_of(x)
    if sh is None:
        return LOST, None
    dim %= len(sh)
    if isinstance(sx, Rows) and sx.dim == dim:
        if is_iota(idx, sh[dim]) or si == POS:
            return sx, None
        return LOST, "an index_select that picks rows of the batch by value"
    if si is not None:
        if sx is not None or not isinstance(si, Rows):
            return LOST, "an index_select that pairs rows with other rows" if sx is not None else None
        return Rows(dim), None
    return sx, None


def _gather(node: fx.Node, states: dict):
    x, dim, idx = node.args[:3]
    sx, si, sh = rows_of(states, x), rows_of(states, idx), shape_of(x)
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
    sx, sh = rows_of(states, x), shape_of(x)
    if sh is None:
        return LOST, None
    dim %= len(sh)
    states_in = [sx] + [rows_of(states, a) for a in rest]
    if name.startswith("index_"):
        si = rows_of(states, idx)
        src = [rows_of(states, a) for a in rest[1:]]
        if si == POS or (isinstance(idx, fx.Node) and is_iota(idx, sh[dim])):
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
    sx, sh = rows_of(states, x), shape_of(x)
    if sh is None:
        return LOST, None
    pos = [i for i, t in enumerate(indices) if t is not None]
    sv = rows_of(states, values)
    bools = [i for i in pos if getattr(indices[i].meta.get("val"), "dtype", None) == torch.bool]
    if bools and len(pos) == 1:
        sm = rows_of(states, indices[pos[0]])
        if sm is None and sv is None:
            return sx, None
        if isinstance(sx, Rows) and isinstance(sm, Rows) and sm.dim == sx.dim - pos[0] and sv is None:
            return sx, None    # x[mask] = constant, the mask per row: an elementwise write
        if sx is None and isinstance(sm, Rows) and sv is None:
            return Rows(sm.dim + pos[0]), None
        return LOST, "a masked write that moves values between rows"
    if len(pos) == 1 and rows_of(states, indices[pos[0]]) == POS and is_iota(values, sh[pos[0]]) \
            and len(sh) == 1:
        return POS, None   # inv[perm] = arange(n): the inverse permutation, positions again
    if isinstance(sx, Rows) and sx.dim in pos:
        idx = indices[sx.dim]
        if not (is_iota(idx, sh[sx.dim]) or rows_of(states, idx) == POS):
            return LOST, "an index_put that writes rows of the batch by position or value"
        return sx, None
    if any(rows_of(states, indices[i]) is not None for i in pos):
        return LOST, "an index_put whose index depends on the batch"
    if sv is not None and sx is None:
        return LOST, None
    return sx, None


INDEX_OPS = INDEXING   # (the name experts.py imports)


def index_rule(node: fx.Node, name: str, states: dict, rows: int):
    """(row state, reason) of an indexing op (name in INDEXING)."""
    if name in ("index", "_unsafe_index"):
        return _index(node, states, rows)
    if name == "index_select":
        return _index_select(node, states, rows)
    if name in ("gather", "take_along_dim"):
        return _gather(node, states)
    if name in ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"):
        return _index_put(node, states, rows)
    return _scatter(node, name, states, rows)
