"""Helpers of passes/cp_recurrence.py that compare two steps of an unrolled loop op for op
(the same ops, positions b further, the same constants), move position-free values, and
copy metadata. Pure functions over fx nodes."""
from __future__ import annotations

import torch.fx as fx

from threefold.ir.program import tf
from threefold.ops.families import args_of, op_name

__all__ = ["derives", "hoist", "refine", "flat", "writes_into", "meta_like", "same"]


def derives(a, c, bound: dict, depth: int) -> bool:
    """The initial value `a` is computed from other initial values (`bound`: each -> its state)
    as the state `c` is from theirs, op for op."""
    if not isinstance(a, fx.Node) or not isinstance(c, fx.Node):
        return not isinstance(a, fx.Node) and not isinstance(c, fx.Node) and a == c
    if a in bound:
        return bound[a] is c
    if a is c:
        return True
    if depth == 0 or a.op != "call_function" or c.op != "call_function" or a.target != c.target \
            or len(a.args) != len(c.args) or set(a.kwargs) != set(c.kwargs):
        return a is c or same(a, c, 6)
    fa, fc = flat(a), flat(c)
    used = any(isinstance(x, fx.Node) and x in bound for _, x in fa)
    ok = [at for at, _ in fa] == [at for at, _ in fc] and all(derives(x, y, bound, depth - 1)
                                                              for (_, x), (_, y) in zip(fa, fc))
    return ok and (used or any(isinstance(x, fx.Node) and derives(x, y, bound, depth - 1) and x is not y
                               for (_, x), (_, y) in zip(fa, fc)))


def hoist(x: fx.Node, before: fx.Node, order: dict, inside: set) -> bool:
    """Move the position-free value x (and what it is made of) before `before`; False where
    it cannot move (a value of the loop, an impure call)."""
    if order[x] < order[before]:
        return True
    if x in inside or x.op != "call_function" or x.is_impure():
        return False
    if not all(hoist(a, before, order, inside) for a in x.all_input_nodes):
        return False
    before.prepend(x)
    order[x] = order[before] - 0.5
    return True


def refine(pairs: dict) -> None:
    """Keep the matches (g, h) that g's readers agree with: where a reader u of g is matched,
    one of u's matches reads h where u reads g (the num and den updates of a step both multiply
    the same decay: the op alone matches either)."""
    changed = True
    while changed:
        changed = False
        for g, hs in pairs.items():
            keep = []
            for h in hs:
                ok = True
                for u in g.users:
                    if pairs.get(u) and not any(_reads_at(hu, h, _where(u, g)) for hu in pairs[u]):
                        ok = False
                        break
                keep.append(h) if ok else None
            if len(keep) != len(hs):
                pairs[g], changed = keep, True


def flat(node: fx.Node) -> list:
    out = []

    def walk(v, at):
        if isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, at + (i,))
        else:
            out.append((at, v))
    walk(list(node.args), ("args",))
    for k in sorted(node.kwargs):
        walk(node.kwargs[k], ("kw", k))
    return out


def _where(u: fx.Node, g: fx.Node) -> set:
    return {at for at, v in flat(u) if v is g}


def _reads_at(hu: fx.Node, h: fx.Node, where: set) -> bool:
    at_hu = dict(flat(hu))
    return all(at_hu.get(at) is h for at in where)


def writes_into(u: fx.Node, view: fx.Node) -> bool:
    return u.op == "call_function" and op_name(u) == "copy_" and args_of(u)["self"] is view


def meta_like(x: fx.Node) -> dict:
    meta = {k: v for k, v in x.meta.items() if k in ("val", "on_mesh", "tensor_meta")}
    meta["tf"] = dict(tf(x))
    return meta


def same(a, c, depth: int) -> bool:
    """Two position-free nodes computing the same value (a copy the trace did not merge)."""
    if a is c:
        return True
    if depth == 0 or not isinstance(a, fx.Node) or not isinstance(c, fx.Node) or a.op != "call_function" \
            or c.op != "call_function" or a.target != c.target or len(a.args) != len(c.args) \
            or set(a.kwargs) != set(c.kwargs):
        return False
    pairs = list(zip(a.args, c.args)) + [(a.kwargs[k], c.kwargs[k]) for k in a.kwargs]
    for x, y in pairs:
        if isinstance(x, fx.Node) or isinstance(y, fx.Node):
            if not same(x, y, depth - 1):
                return False
        elif x != y:
            return False
    return True
