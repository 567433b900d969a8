"""Experts computed densely, every expert on its own copy of the tokens, found from structure.

A *dense expert matmul* is a batched matmul `x @ w` (bmm, or matmul of two 3-D tensors)
whose operand `w` [E, in, out] is a parameter (or a view or cast of one that keeps the
experts on dim 0, expert_match.weight_chain) and whose other operand `x` [E, T, in] carries
the same E on dim 0, giving [E, T, out]: expert e multiplies its own slice x[e] of tokens
(Llama 4's experts: every token repeated once per expert and scaled by its router score,
then one bmm over the stacked experts). Nothing but the shapes and the parameter is read.

Under ep=N the slices x[e] are independent: expert e's slice goes to the rank holding e,
the experts' ops run there, and the result slice comes back (runtime/dense_experts.py); the
sum over experts (or whatever combines them) stays on the tokens' rank, in the model's order.
A *dense region* is the dense expert matmuls linked by values that keep the experts on dim 0
(the activation, the gate product, chunk) plus the ops on the paths between them; passes/
experts.py builds and checks it as it does a grouped region, with the experts as its rows.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.passes.expert_match import _param_root, _val, schema_arg

# batched matmuls and the schema names of their two operands
_BATCHED = {"bmm": ("self", "mat2"), "matmul": ("self", "other")}


def dense_expert_matmul(node: fx.Node):
    """(x, weight operand, parameter placeholder) of a dense expert matmul, else None."""
    if node.op != "call_function" or op_name(node) not in _BATCHED:
        return None
    x, w = (schema_arg(node, a) for a in _BATCHED[op_name(node)])
    if not (isinstance(x, fx.Node) and isinstance(w, fx.Node)):
        return None
    vx, vw, out = _val(x), _val(w), _val(node)
    if not all(isinstance(v, torch.Tensor) for v in (vx, vw, out)):
        return None
    if vx.dim() != 3 or vw.dim() != 3 or out.dim() != 3:
        return None
    if not (vx.shape[0] == vw.shape[0] == out.shape[0]) or vx.shape[2] != vw.shape[1]:
        return None
    param = _param_root(w)
    if param is None or _param_root(x) is not None:   # two parameters: not tokens against experts
        return None
    return x, w, param


def dense_groups(graph: fx.Graph) -> list[list[fx.Node]]:
    """The dense expert matmuls, grouped: two are in one group when a chain of values that
    all keep E on dim 0 leads from one to the other (one expert's MLP), in graph order."""
    mms = [n for n in graph.nodes if dense_expert_matmul(n) is not None]
    parent = {m: m for m in mms}

    def root(m):
        while parent[m] is not m:
            m = parent[m]
        return m
    for m in mms:
        experts = _val(m).shape[0]
        for other in _expert_reach(m, experts):
            if other in parent and root(other) is not root(m):
                parent[root(other)] = root(m)
    groups: dict = {}
    for m in mms:
        groups.setdefault(root(m), []).append(m)
    return list(groups.values())


def _expert_reach(start: fx.Node, experts: int) -> set:
    """Nodes reached from `start` through values whose every tensor has E on dim 0."""
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen and _keeps_experts(u, experts):
                seen.add(u)
                todo.append(u)
    return seen


def _keeps_experts(n: fx.Node, experts: int) -> bool:
    v = _val(n)
    vals = v if isinstance(v, (tuple, list)) else [v]
    tensors = [t for t in vals if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.dim() >= 1 and t.shape[0] == experts for t in tensors)
