"""cp rules for routing sorts: token rows sorted on this rank (MoE dispatch) and put back.

A mixture-of-experts block sorts its token-expert rows by expert over the merged token dim
([b*s*k]: the sequence merged with the batch and the top-k picks), runs each expert's rows
through a grouped matmul whose offsets count the rows per expert, and puts the rows back in
token order (an inverse permutation, index_add or index_put). Under cp each rank holds its
own tokens: running that block on them alone is what one process does to those tokens, as
long as every op between the sort and the way back treats each row alone. So a sort whose
indices route rows (they index a value split along the sequence) does not gather the
sequence: its outputs are `Perm` (this rank's rows in the sort's order), the row counts per
expert and their cumsum are `RANK_LOCAL` (they may only feed an expert matmul's offsets),
and the way back gives the sequence placement again. Any other op on such values is refused
in one line, never run as if the rows were positions.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from threefold.ops import families as fam
from threefold.passes.cp_masks import input_free
from threefold.passes.cp_rules.core import (RANK_LOCAL, ROWS_RULE, Call, Perm, Ptr, Seq, _fail, _norm, _NoRule,
                                            _val, decision_for, rule)
from threefold.passes.experts import expert_matmul

_INDEXING = fam.PERMUTATION_INDEXING
_KEEPS_PTR = fam.KEEPS_ROW_NUMBERS
_SORTS = {"sort", "argsort"}
_COUNTS = {"histc", "bincount"}


def routes_rows(sort: fx.Node) -> bool:
    """The sort's indices index a value (a routing sort), read through scalar arithmetic."""
    idx = [u for u in sort.users if u.target is operator.getitem and u.args[1] == 1] \
        if fam.op_name(sort) == "sort" else [sort]
    stack, seen = list(idx), set()
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in seen:
                continue
            seen.add(u)
            name = fam.op_name(u)
            if name in _INDEXING and u.args[0] is not x:
                return True
            if name in _KEEPS_PTR:
                stack.append(u)
    return False


def feeds_offsets(node: fx.Node, depth: int = 24) -> bool:
    """Every use of `node` (through ops with no other sequence input) ends as an expert
    matmul's offsets: a count of this rank's rows per expert."""
    stack, seen, found = [node], set(), False
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in seen or fam.op_name(u) == "_assert_tensor_metadata":
                continue
            seen.add(u)
            if len(seen) > depth:
                return False
            em = expert_matmul(u)
            if em is not None:
                if em[3] is not x:
                    return False
                found = True
                continue
            if u.op != "call_function" or any(a is not x and not input_free(a) for a in u.all_input_nodes):
                return False
            stack.append(u)
    return found


def sorted_rows(c: Call, s0: Seq):
    """A sort / argsort along the sequence whose indices route rows: Perm outputs."""
    src = s0
    d = s0.dim
    if fam.op_name(c.node) == "argsort":
        return Perm(d, c.node, src, ptr=True)
    return (Perm(d, c.node, src), Perm(d, c.node, src, ptr=True))


@rule(*_COUNTS)
def counts(c: Call):
    """Rows per expert (histc / bincount / a sum over the rows) of this rank's rows: RANK_LOCAL
    when it only feeds expert matmul offsets."""
    if not feeds_offsets(c.node):
        _fail(c, "counts this rank's rows for something other than an expert matmul's offsets")
    return RANK_LOCAL


def _rows(c: Call):
    """The decision for a call that reads Perm / Ptr / RANK_LOCAL values."""
    places = {a: c.place(a) for a in c.node.all_input_nodes}
    name = c.name
    if name == "_assert_tensor_metadata":
        return None
    if name == "getitem":
        s = places[c.node.args[0]]
        return s[c.node.args[1]] if isinstance(s, tuple) else s
    if all(p is None or p == RANK_LOCAL for p in places.values()):
        return RANK_LOCAL
    em = expert_matmul(c.node)
    if em is not None:
        x, w, _, offs = em
        if isinstance(places.get(x), Perm) and places.get(w) is None and places.get(offs) in (RANK_LOCAL, None):
            return Perm(0, places[x].key, places[x].src)
        _fail(c, "is an expert matmul whose rows are not this rank's rows sorted by expert")
    if any(p == RANK_LOCAL for p in places.values()):
        _fail(c, "reads rows per expert counted on this rank outside an expert matmul")
    if name in _COUNTS:
        return counts(c)
    if name in ("index", "index_put", "index_put_", "index_add", "index_add_"):
        return _index_rows(c, places)
    if name in _SORTS and isinstance(places.get(c.x), Perm) and places[c.x].ptr \
            and _norm(c.args.get("dim", -1), _val(c.x).dim()) == places[c.x].dim:
        p = places[c.x]                                   # argsort(perm): the inverse permutation
        return Ptr(p.src.at(p.dim), p.key) if name == "argsort" else _fail(c, "sorts a permutation")
    return _as_positions(c, places)


def _as_positions(c: Call, places: dict):
    """Any other op: the sequence rules, reading the Perm rows as positions of their own length
    (so an op that mixes rows, or meets a value that varies along them, is refused)."""
    perms = {p for p in places.values() if isinstance(p, Perm)}
    if len(perms) != len({(p.key, p.src) for p in perms}) or len({p.key for p in perms}) != 1 \
            or any(p is not None and not isinstance(p, Perm) for p in places.values()):
        _fail(c, "combines rows sorted on this rank (a routing sort) with values in another order")
    key, src = perms.pop().key, next(p.src for p in places.values() if isinstance(p, Perm))
    ptr = all(p.ptr for p in places.values() if isinstance(p, Perm)) and c.name in _KEEPS_PTR \
        and sum(isinstance(a, fx.Node) and _val(a) is not None and _val(a).dim() > 0 for a in c.node.all_input_nodes) == 1
    rows = next(_val(a).shape[p.dim] for a, p in places.items() if isinstance(p, Perm))
    state = {a: (Seq(p.dim) if isinstance(p, Perm) else p) for a, p in places.items()}
    r = decision_for(c.name, c.node)
    if r is None or isinstance(r, str):
        r = decision_for(c.name)                          # by name: floor_divide is untagged on its node
    if isinstance(r, str) or fam.family(c.node) == "view" and not _keeps_rows(c, places):
        _fail(c, "reads rows sorted on this rank (a routing sort) in a way cp cannot follow")
    try:
        out = r(Call(c.node, c.name, c.args, state, _Rows(c.stage, rows)))
    except _NoRule as exc:
        _fail(c, f"{exc} (of rows sorted on this rank by a routing sort, not positions)")

    def back(s):
        if isinstance(s, tuple):
            return tuple(back(x) for x in s)
        if isinstance(s, Seq):
            if s.inner != 1:
                _fail(c, "merges rows sorted on this rank with another dim")
            return Perm(s.dim, key, src, ptr)
        return s
    return back(out)


def _keeps_rows(c: Call, places: dict) -> bool:
    """A view that keeps the rows dim whole (same size, same elements per row)."""
    (a, p), = [(a, p) for a, p in places.items() if isinstance(p, Perm)]
    shape_in, shape_out = _val(a).shape, c.out.shape
    per_row = shape_in[p.dim + 1:].numel()
    return any(shape_out[e] == shape_in[p.dim] and shape_out[e + 1:].numel() == per_row for e in range(len(shape_out)))


class _Rows:
    """The stage as the sequence rules read it, with the rows' count as the length."""
    def __init__(self, stage, rows: int):
        self._stage, self.seq_len = stage, rows

    def __getattr__(self, k):
        return getattr(self._stage, k)


def _index_rows(c: Call, places: dict):
    """Rows picked by a routing sort's indices (tokens[perm // k], weights[perm]), a table read
    at sorted values (bias[expert_ids_sorted]), and the way back (y[inverse], index_put /
    index_add of sorted rows at perm): the sequence placement of the token order."""
    name, a = c.name, c.args
    x = a["self"]
    sx = places.get(x)
    if name == "index":
        given = [(i, t) for i, t in enumerate(a["indices"]) if t is not None]
        if len(given) != 1:
            _fail(c, "indexes rows sorted on this rank with several indices")
        i, t = given[0]
        st = places.get(t)
        if isinstance(st, Perm) and st.ptr and isinstance(sx, Seq) and sx.dim == i:
            return Perm(i + st.dim, st.key, st.src)          # rows gathered in the sort's order
        if isinstance(st, Perm) and sx is None:
            return Perm(i + st.dim, st.key, st.src)          # a table read per sorted row
        if isinstance(st, Ptr) and isinstance(sx, Perm) and sx.dim == i and sx.key == st.key:
            return st.seq.at(i + st.seq.dim)                 # back in token order
        _fail(c, "indexes with rows sorted on this rank in a way cp cannot follow")
    if name in ("index_put", "index_put_"):
        (t,) = [t for t in a["indices"] if t is not None] or [None]
        st, sv = places.get(t), places.get(a["values"])
        if not (isinstance(st, Perm) and st.ptr and st.dim == 0 and _val(x).dim() == _val(t).dim()):
            _fail(c, "puts values at rows sorted on this rank in a way cp cannot follow")
        if sv is None and _is_arange(a["values"], _val(t).shape[0]):
            return Ptr(st.src.at(0), st.key)                 # inverse[perm] = arange: the inverse permutation
        if isinstance(sv, Perm) and sv.key == st.key and sv.dim == 0:
            return st.src.at(0)                              # sorted rows scattered back to token order
        _fail(c, "puts values at rows sorted on this rank in a way cp cannot follow")
    d = _norm(a["dim"], _val(x).dim())                       # index_add(self, dim, perm // k, rows)
    st, ss = places.get(a["index"]), places.get(a["source"])
    if isinstance(sx, Seq) and sx.dim == d and isinstance(st, Perm) and st.ptr and isinstance(ss, Perm) \
            and ss.key == st.key and ss.dim == d:
        return sx
    _fail(c, "adds rows sorted on this rank back in a way cp cannot follow")


def _is_arange(node, n: int) -> bool:
    v = _val(node)
    return fam.op_name(node) == "arange" and isinstance(v, torch.Tensor) and v.dim() == 1 \
        and v.shape[0] == n


ROWS_RULE.append(_rows)
