"""Experts computed densely, every expert on its own copy of the tokens, found from structure.

A *dense expert matmul* multiplies a stacked expert weight `w` [E, ...] (a parameter, or a
view or cast of one that keeps the experts on dim 0, expert_match.weight_chain) with an
activation `x` that carries the same E experts on one of its dims, each expert's slice of
`x` by that expert's weight only:
  - a batched matmul `x @ w` (bmm, or matmul) of x [..., E, T, in] by w [E, in, out], giving
    [..., E, T, out] (Llama 4's experts: every token repeated once per expert and scaled by
    its router score, then one bmm over the stacked experts; matmul's broadcast batch dims
    may come before E), or of x [T, in] by w, every expert on every token;
  - an einsum of the two, read from its equation: the weight's expert letter (its dim 0) is
    also a letter of the activation and of the output (kept, not contracted), and the two
    contract at least one other letter ('etd,edf->etf', 'becd,edf->becf', soft MoE's slots
    'bnd,nde->bne'). Where the expert letter sits in the activation and in the output is
    the expert dim of each (any dim, not only 0). An activation without the expert letter
    ('btc,ecf->betf': every expert on every token, a dense mixture) is read whole by every
    expert: `x_dim` None.
Nothing but the equation, the shapes and the parameter is read.

Under ep=N the slices of x along its expert dim are independent: expert e's slice goes to
the rank holding e (an x without experts goes whole to every rank), the experts' ops run
there, and the result slice comes back
(runtime/dense_experts.py); the sum over experts (or whatever combines them) stays on the
tokens' rank, in the model's order. A *dense region* is the dense expert matmuls linked by
values that keep the experts on some dim (the activation, the gate product, chunk; followed
by the batch-row rules, passes/row_rules.py, with the experts as the rows) plus the ops on
the paths between them; passes/experts.py builds and checks it as it does a grouped region,
with the experts as its rows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.passes.expert_match import _param_root, _val, schema_arg
from threefold.passes.row_rules import propagate
from threefold.passes.row_state import Rows, explicit_einsum

# batched matmuls and the schema names of their two operands
_BATCHED = {"bmm": ("self", "mat2"), "matmul": ("self", "other")}


class DenseMatmul(NamedTuple):
    x: fx.Node          # the activation: the experts' token slices
    w: fx.Node          # the weight operand, [E, ...] with the experts on dim 0
    param: fx.Node      # the parameter placeholder w is a view or cast of
    x_dim: int | None   # the experts' dim in x; None: x has none, every expert reads all of it
    out_dim: int        # and in the product


def dense_expert_matmul(node: fx.Node) -> DenseMatmul | None:
    """The parts of a dense expert matmul, else None."""
    if node.op != "call_function":
        return None
    name = op_name(node)
    if name == "einsum":
        return _einsum_experts(node)
    if name not in _BATCHED:
        return None
    x, w = (schema_arg(node, a) for a in _BATCHED[name])
    if not (isinstance(x, fx.Node) and isinstance(w, fx.Node)):
        return None
    vx, vw, out = _val(x), _val(w), _val(node)
    if not all(isinstance(v, torch.Tensor) for v in (vx, vw, out)):
        return None
    if vw.dim() != 3 or vx.dim() < 1 or vx.shape[-1] != vw.shape[1] or out.dim() < 3:
        return None
    if name == "matmul" and vx.dim() == 2 and out.shape[0] == vw.shape[0]:
        return _tokens_by_experts(x, w, None, 0)   # [T, in] @ [E, in, out]: every expert on every token
    if vx.dim() < 3 or out.dim() != vx.dim() or (name == "bmm" and vx.dim() != 3):
        return None
    # matmul broadcasts w's batch dim (E) against x's third dim from the end
    if not (vx.shape[-3] == vw.shape[0] == out.shape[-3]):
        return None
    return _tokens_by_experts(x, w, vx.dim() - 3, vx.dim() - 3)


def _einsum_experts(node: fx.Node) -> DenseMatmul | None:
    """An einsum of two operands, one a stacked expert weight whose expert letter (dim 0) the
    other operand and the output keep, the two contracting at least one other letter."""
    eq, ops = schema_arg(node, "equation"), schema_arg(node, "tensors")
    if not isinstance(eq, str) or not isinstance(ops, (list, tuple)) or len(ops) != 2:
        return None
    if not all(isinstance(o, fx.Node) and isinstance(_val(o), torch.Tensor) for o in ops):
        return None
    eq = explicit_einsum(eq, [_val(o).dim() for o in ops])   # '...' as letters of their own
    if eq is None:
        return None
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    if any(len(set(s)) != len(s) for s in subs + [out]):
        return None   # a repeated letter (a diagonal or a trace): not a plain product
    if not all(_val(o).dim() == len(s) for o, s in zip(ops, subs)):
        return None
    weights = [i for i, o in enumerate(ops) if _param_root(o) is not None]
    if len(weights) != 1:   # none, or two parameters: not tokens against experts
        return None
    wi = weights[0]
    xs, ws = subs[1 - wi], subs[wi]
    e = ws[0]
    if e not in out:
        return None   # the experts contracted: a sum over experts inside the product
    if not any(c in xs and c not in out for c in ws if c != e):
        return None   # no contraction with the weight: a scale, not a matmul
    x, w = ops[1 - wi], ops[wi]
    if e not in xs:   # every expert on every token ('btc,ecf->betf'): x is read whole
        return _tokens_by_experts(x, w, None, out.index(e))
    if _val(x).shape[xs.index(e)] != _val(w).shape[0]:
        return None
    return _tokens_by_experts(x, w, xs.index(e), out.index(e))


def _tokens_by_experts(x: fx.Node, w: fx.Node, x_dim: int, out_dim: int) -> DenseMatmul | None:
    param = _param_root(w)
    if param is None or _param_root(x) is not None:   # two parameters: not tokens against experts
        return None
    return DenseMatmul(x, w, param, x_dim, out_dim)


def dense_groups(graph: fx.Graph) -> list[list[fx.Node]]:
    """The dense expert matmuls, grouped: two are in one group when a chain of values that
    all keep the E experts on some dim leads from one to the other (one expert's MLP), in
    graph order."""
    found = {n: dense_expert_matmul(n) for n in graph.nodes}
    mms = [n for n, m in found.items() if m is not None]
    parent = {m: m for m in mms}

    def root(m):
        while parent[m] is not m:
            m = parent[m]
        return m
    for m in mms:
        experts = _val(found[m].w).shape[0]
        for other in _expert_reach(m, found[m].out_dim, experts):
            if other in parent and root(other) is not root(m):
                parent[root(other)] = root(m)
    groups: dict = {}
    for m in mms:
        groups.setdefault(root(m), []).append(m)
    return list(groups.values())


def _expert_reach(start: fx.Node, dim: int, experts: int) -> set:
    """Nodes reached from `start` (the experts on `dim`) through ops that keep each expert's
    slice in place on some dim (the batch-row rules, with the experts as the rows)."""
    states, todo = {start: Rows(dim, 1)}, [start]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in states:
                continue
            state, reason = propagate(u, states, experts)
            if reason is None and _keeps_experts(u, state, experts):
                states[u] = state
                todo.append(u)
    return set(states) - {start}


def _keeps_experts(n: fx.Node, state, experts: int) -> bool:
    v = _val(n)
    vals = v if isinstance(v, (tuple, list)) else [v]
    parts = state if isinstance(state, tuple) else (state,)
    tensors = [t for t in vals if isinstance(t, torch.Tensor)]
    return bool(tensors) and len(parts) == len(vals) and all(
        isinstance(s, Rows) and s.dim < t.dim() and t.shape[s.dim] == experts
        for s, t in zip(parts, vals) if isinstance(t, torch.Tensor))
