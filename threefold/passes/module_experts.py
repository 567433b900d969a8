"""Experts held as separate modules (an nn.ModuleList applied one by one), found from data flow.

A *module expert group* is N >= 2 computations ("members") whose results are combined by one
op that treats them alike:
  - a join: `stack` / `cat` of exactly the members' results (Soft MoE's slots: the slots are
    cut into one piece per expert, each expert runs on its piece, the outputs are stacked);
  - a sum: the leaves of one tree of plain `add`s (a dense mixture: every expert sees every
    token and the outputs, each scaled by its router weight, are summed).
A member is the result `t` of the combine together with every op between `t` and the
parameters that only `t` depends on (its *own* parameters): the projections, activations,
router scaling. Members qualify when they all own parameters and the shapes of those
parameters agree (N projections of one shape). No module, class or parameter name is read.

Under ep=N (N divides the member count) member e runs on ep rank e // (members / N), which is
the only rank holding its parameters: each rank sends every member's outside inputs (its
piece, or the shared tensor once) to the member's rank, which runs the member on each
source's inputs separately and sends the results back (runtime/expert_modules.py). The
combine itself stays where it was, on the token's own rank, so a rank ends with exactly the
values one process computes for its rows: no op needs to be row-wise and no sum is reordered.

Guarantees: `chunk.module_experts` is a tuple of groups {"name", "combine" (op), "experts"
(N), "members": [{"nodes", "inputs", "params" (placeholder names), "output"}], "nodes" (all
members' nodes in graph order), "owned" (FQN -> member index)}. A group that cannot be split
exactly (a member value read outside it, a random op inside, inputs of different shapes) is a
one-line PlanError naming why, under ep only; without ep nothing is searched.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ops import families as fam
from threefold.passes.cost import op_name
from threefold.passes.expert_match import _val, schema_arg


def module_expert_groups(graph: fx.Graph, refusals: list | None = None) -> list[dict]:
    """The graph's module expert groups. A group ep cannot split exactly is a PlanError, or
    with `refusals` given, left out (inline: exact, not split) and its reason appended."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    params = [n for n in graph.nodes if n.op == "placeholder" and tf(n).get("kind") == "param"]
    anc: dict = {}
    groups, taken = [], set()
    for combine, terms in _combines(graph):
        members = _members(terms, params, anc)
        if len(members) < 2:
            continue
        name = tf(combine).get("module", "") or combine.name
        built = [_member(t, own, anc, order) for t, own in members]
        nodes = {x for m in built for x in m["nodes"]}
        if nodes & taken:   # a group inside another's member: the outer one moves it whole
            continue
        try:
            _check_alike(name, built)
        except PlanError as err:
            if refusals is None:
                raise
            refusals.append(str(err))
            continue
        taken |= nodes
        groups.append({
            "name": name, "combine": op_name(combine), "experts": len(built),
            "members": [{"nodes": [n.name for n in m["nodes"]], "inputs": [a.name for a in m["inputs"]],
                         "params": [p.name for p in m["params"]], "output": m["output"].name} for m in built],
            "nodes": [n.name for n in sorted(nodes, key=order.get)],
            "owned": {tf(p)["fqn"]: e for e, m in enumerate(built) for p in m["params"]}})
    return groups


def _combines(graph: fx.Graph):
    """(combine node, its terms): joins of a list of tensors, and roots of plain add trees."""
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n)
        if name in fam.JOINS:
            tensors = schema_arg(n, "tensors")
            if isinstance(tensors, (list, tuple)) and all(isinstance(t, fx.Node) for t in tensors):
                yield n, list(tensors)
        elif _plain_add(n) and not (len(n.users) == 1 and _plain_add(next(iter(n.users)))):
            yield n, _add_leaves(n)


def _plain_add(n: fx.Node) -> bool:
    return n.op == "call_function" and op_name(n) == "add" and schema_arg(n, "alpha", 1) == 1


def _add_leaves(root: fx.Node) -> list[fx.Node]:
    """The tensors an add tree sums (an inner add read only by the tree is part of it)."""
    leaves, todo = [], [root]
    while todo:
        n = todo.pop(0)
        for a in (schema_arg(n, "self"), schema_arg(n, "other")):
            if not isinstance(a, fx.Node):
                continue    # a Python number (sum()'s start 0)
            if _plain_add(a) and len(a.users) == 1:
                todo.append(a)
            elif a not in leaves:
                leaves.append(a)
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    return sorted(leaves, key=order.get)   # the experts in the order the model applies them


def _ancestors(n: fx.Node, memo: dict) -> frozenset:
    if n not in memo:
        out, todo = set(), list(n.all_input_nodes)
        while todo:
            m = todo.pop()
            if m in out:
                continue
            if m in memo:
                out |= memo[m] | {m}
                continue
            out.add(m)
            todo.extend(m.all_input_nodes)
        memo[n] = frozenset(out)
    return memo[n]


def _members(terms: list[fx.Node], params: list[fx.Node], anc: dict) -> list[tuple]:
    """(term, its own parameters) for the terms that own parameters, of the most common
    parameter-shape signature; [] when fewer than two agree."""
    uses = {t: [p for p in params if p in _ancestors(t, anc)] for t in terms}
    own = {t: [p for p in ps if not any(p in uses[o] for o in terms if o is not t)] for t, ps in uses.items()}
    by_sig: dict = {}
    for t in terms:
        if own[t] and isinstance(_val(t), torch.Tensor):
            sig = tuple((tuple(_val(p).shape), _val(p).dtype) for p in own[t])
            by_sig.setdefault(sig, []).append(t)
    best = max(by_sig.values(), key=len, default=[])
    return [(t, own[t]) for t in best] if len(best) >= 2 else []


def _member(t: fx.Node, own: list[fx.Node], anc: dict, order: dict) -> dict:
    """The ops between a term's own parameters and the term, and what they read besides."""
    inside = _ancestors(t, anc) | {t}
    nodes, todo = set(), list(own)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in inside and u not in nodes and u.op == "call_function":
                nodes.add(u)
                todo.append(u)
    nodes = sorted(nodes, key=order.get)
    inputs = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in nodes and a not in own and a not in inputs:
                inputs.append(a)
    return {"nodes": nodes, "inputs": inputs, "params": own, "output": t}


def _check_alike(name: str, members: list[dict]) -> None:
    """Each member is a pure function of its inputs and own parameters whose only result is
    its term, and the members take and give tensors of one shape (they are exchanged stacked)."""
    def refuse(why: str):
        raise PlanError(f"plan ep: the {len(members)} experts at {name} (separate modules applied one by one) "
                        f"cannot be split exactly: {why}; drop ep for this model")
    first = members[0]
    for e, m in enumerate(members):
        inside = set(m["nodes"])
        for n in m["nodes"]:
            if n is not m["output"] and any(u not in inside for u in n.users):
                refuse(f"{op_name(n)} ({n.name}) of expert {e} is also read outside it")
            if _draws_random(n):
                refuse(f"{op_name(n)} ({n.name}) of expert {e} draws random numbers, which its rank cannot "
                       "draw as one process does")
            if _writes_input(n, inside):
                refuse(f"{op_name(n)} ({n.name}) of expert {e} writes a tensor computed outside it")
        for p in m["params"]:
            if any(u not in inside for u in p.users):
                refuse(f"parameter {tf(p).get('fqn', p.name)} of expert {e} is also read outside it")
            if _val(p).dim() == 0:
                refuse(f"parameter {tf(p).get('fqn', p.name)} of expert {e} is a scalar")
        for a in m["inputs"]:
            if not isinstance(_val(a), torch.Tensor):
                refuse(f"expert {e} reads {a.name}, which is not a tensor")
        if _sig(m["inputs"]) != _sig(first["inputs"]) or _sig([m["output"]]) != _sig([first["output"]]):
            refuse(f"expert {e} reads or gives tensors of other shapes than expert 0")


def _sig(nodes) -> list:
    return [(tuple(_val(n).shape), _val(n).dtype) for n in nodes]


def _draws_random(n: fx.Node) -> bool:
    if "random_ops" in getattr(n.target, "__module__", ""):   # rewritten by passes/random_ops.py
        return True
    if op_name(n).rstrip("_") not in fam.RANDOM:
        return False
    p = schema_arg(n, "p")
    return not (isinstance(p, (int, float)) and p == 0)


def _writes_input(n: fx.Node, inside: set) -> bool:
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return False
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            v = schema_arg(n, a.name)
            if isinstance(v, fx.Node) and v not in inside:
                return True
    return False
