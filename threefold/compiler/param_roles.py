"""Each parameter's role in the graph (what weight decay reads), decided at compile time.

A parameter's role is what the traced graph does with it, following it through ops that
only change its view or dtype (t, transpose, view, _to_copy, ...):
  * "matmul": a matrix operand of a matmul-like op (linear's and conv's weight, either side
    of mm/bmm/matmul/einsum, addmm's two factors);
  * "embedding": the table of an embedding lookup (also when it is tied to an LM head that
    multiplies with it);
  * "other": everything else (norm scales and shifts, biases, gates, position tables).
The manifest stores them (`param_roles`), so nothing after compile reads the graph.
"""
from __future__ import annotations

import operator

from threefold.roles import EMBEDDING, MATMUL, OTHER

from threefold.ir.program import tf
from threefold.ops.families import SAME_MATRIX

# op -> argument positions that are matrix operands
_MATMUL_ARGS = {
    "linear": (1,), "mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "mv": (0,),
    "addmm": (1, 2), "addbmm": (1, 2), "baddbmm": (1, 2), "addmv": (1,),
    "convolution": (1,), "_convolution": (1,), "conv1d": (1,), "conv2d": (1,), "conv3d": (1,),
    "conv_transpose1d": (1,), "conv_transpose2d": (1,), "conv_transpose3d": (1,),
    "einsum": (1,), "tensordot": (0, 1),
}
# (the tensor-parallel pass's vocab-parallel lookup is an embedding too: roles must not
# depend on the plan)
_EMBEDDING_ARGS = {"embedding": (0,), "embedding_bag": (0,), "_embedding_bag": (0,),
                   "vocab_parallel_embedding": (0,)}


def _op(node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _positions(user, node) -> list[int]:
    """Argument positions of `user` that hold `node` (directly or inside a list)."""
    out = []
    for i, a in enumerate(user.args):
        if a is node or (isinstance(a, (list, tuple)) and any(x is node for x in a)):
            out.append(i)
    return out


def _role_of(node) -> str:
    seen, frontier, found = set(), [node], set()
    while frontier:
        n = frontier.pop()
        for user in n.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            name, pos = _op(user), _positions(user, n)
            if name in _EMBEDDING_ARGS and set(pos) & set(_EMBEDDING_ARGS[name]):
                found.add(EMBEDDING)
            elif name in _MATMUL_ARGS and set(pos) & set(_MATMUL_ARGS[name]):
                found.add(MATMUL)
            elif name in SAME_MATRIX and pos and (name == "getitem" or pos[0] == 0):
                frontier.append(user)
    return EMBEDDING if EMBEDDING in found else MATMUL if MATMUL in found else OTHER


def stage_graphs(stage) -> list:
    """The fx graphs of a compiler stage: its whole-model graph, or one per chunk."""
    return [gm.graph for name, gm in stage.graph_modules() if name != "loss_denominator"]


def graph_roles(stage) -> dict[str, str]:
    """Canonical FQN -> role, for every parameter placeholder of a compiled stage (a
    parameter in several chunk graphs, such as a tied embedding, takes the strongest role)."""
    rank = {OTHER: 0, MATMUL: 1, EMBEDDING: 2}
    out: dict[str, str] = {}
    for graph in stage_graphs(stage):
        for n in graph.nodes:
            if n.op == "placeholder" and tf(n).get("kind") == "param":
                role, fqn = _role_of(n), tf(n)["fqn"]
                if rank[role] >= rank[out.get(fqn, OTHER)]:
                    out[fqn] = role
    return out
