"""The compile-time backward split of zero-bubble schedules (plan schedule=zb-h1 | zbv).

Zero-bubble pipelining (Qi et al., arXiv 2401.10241) runs each chunk's backward as B (input
gradients, which the previous stage waits for) and W (weight gradients, free to fill
bubbles). Which ops own weight gradients is a property of the graph: an op reads a weight
operand, a value that depends on trainable parameters and on nothing the batch feeds (the
parameter itself, or a transpose, view, cast or product of parameters and buffers). Every
such op that also reads an activation is written as a call to
`runtime/weight_grad.deferred`, whose backward computes only the activation gradients and
keeps the op's local graph for W; everything else backpropagates in B as before.

Rules (all general over the graph; no op or module names):
  * only ATen ops are split (fused kernels and runtime functions with collectives are not:
    their backward would run twice, or talk to other ranks out of order), never an op
    that writes in place, nor one inside a recomputed segment;
  * every tensor operand must be a top-level positional argument, the output a tensor or a
    tuple/list of tensors;
  * a weight operand computed by ops (not a parameter itself) must feed deferred ops only:
    if B also backpropagated through it, W would walk its graph a second time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.codegen.lines import annotation, wrap_call
from threefold.ir.program import tf


@dataclass(frozen=True)
class DeferredOp:
    weights: tuple[int, ...]        # positions in node.args of the weight operands
    params: tuple[fx.Node, ...]     # the trainable parameter placeholders behind them


def deferred_ops(graph: fx.Graph, skip: set[str] = frozenset()) -> dict[fx.Node, DeferredOp]:
    """The ops whose weight gradients W computes (module docstring); `skip`: node names
    that must stay as they are (recomputed segments)."""
    params_of: dict[fx.Node, frozenset[fx.Node]] = {}   # weight values -> their parameters
    activation: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            kind = tf(n).get("kind")
            if kind == "param" and not tf(n).get("frozen"):
                params_of[n] = frozenset([n])
            elif kind in ("boundary", "input"):
                activation.add(n)
            continue
        if n.op != "call_function":
            continue
        ins = n.all_input_nodes
        if any(a in activation for a in ins):
            activation.add(n)
        elif any(a in params_of for a in ins):
            params_of[n] = frozenset().union(*(params_of[a] for a in ins if a in params_of))
    chosen: dict[fx.Node, DeferredOp] = {}
    for n in graph.nodes:
        if n in activation and n.op == "call_function" and n.name not in skip and _splittable(n):
            weights = tuple(i for i, a in enumerate(n.args) if isinstance(a, fx.Node) and a in params_of)
            if weights:
                params = sorted({p for i in weights for p in params_of[n.args[i]]}, key=lambda p: p.name)
                chosen[n] = DeferredOp(weights, tuple(params))
    # A computed weight value B also backpropagates through (an op B runs reads it, or reads
    # a weight value made from it) must not be walked by W too: do not defer its readers.
    while True:
        in_b = _ancestors([a for n in graph.nodes if n in activation and n not in chosen
                           for a in n.all_input_nodes if a in params_of], params_of)
        bad = [n for n in chosen
               if _ancestors([n.args[i] for i in chosen[n].weights], params_of) & in_b]
        if not bad:
            return chosen
        for n in bad:
            chosen.pop(n)


def _ancestors(values: list[fx.Node], params_of) -> set[fx.Node]:
    """The computed weight values among `values` and the ones they are computed from."""
    stack, seen = list(values), set()
    while stack:
        v = stack.pop()
        if v in seen or v.op != "call_function":
            continue
        seen.add(v)
        stack.extend(a for a in v.all_input_nodes if a in params_of)
    return seen


def _splittable(n: fx.Node) -> bool:
    target = n.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    if target._schema.is_mutable:
        return False
    if any(isinstance(v, fx.Node) for v in n.kwargs.values()):
        return False
    if any(_nested_node(a) for a in n.args):
        return False
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.is_floating_point()
    return (isinstance(val, (tuple, list)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val)
            and any(v.is_floating_point() for v in val))


def _nested_node(a) -> bool:
    if isinstance(a, (list, tuple)):
        return any(isinstance(x, fx.Node) or _nested_node(x) for x in a)
    return False


def splits_backward(plan) -> bool:
    """Does the plan's schedule run B and W separately (zero bubble)?"""
    # lazy: start-up: runtime.schedule loads only on this path
    from threefold.runtime.schedule import SPLIT_KINDS
    return plan.schedule in SPLIT_KINDS


def _straight_line(node: fx.Node, op: DeferredOp) -> str | None:
    """The runtime/weight_grad entry point written for this op without the generic
    dispatch (`linear`, `layer_norm`), or None: only where the weight operands are the
    parameters themselves, at the positions the entry point takes them, no kwargs."""
    if node.kwargs:
        return None
    n = len(node.args)
    if node.target is torch.ops.aten.linear.default and n in (2, 3):
        name, first = "linear", 1
    elif node.target is torch.ops.aten.layer_norm.default and 3 <= n <= 6 and node.args[2] is not None:
        name, first = "layer_norm", 2
    else:
        return None
    operands = [a for a in node.args[first:first + 2] if a is not None]
    positions = tuple(range(first, first + len(operands)))
    if op.weights != positions or set(operands) != set(op.params) or len(operands) != len(op.params):
        return None
    return name


def deferred_line(writer, node: fx.Node, op: DeferredOp, indent: str = "        ") -> list[str]:
    """`y = weight_grad.deferred(self, OP, (args...), weights=(i, ...), params=(p, ...))`,
    or `y = weight_grad.linear(self, x, w, b)` / `layer_norm(...)` where the op allows
    (_straight_line), annotated like any other line plus the parameters whose gradients W
    computes."""
    writer.imports.add("import threefold.runtime.weight_grad as weight_grad")
    positional = [writer._arg(a) for a in node.args]
    fqns = ", ".join(tf(p)["fqn"] for p in op.params)
    comment = f"  # {annotation(node)}  weight grads in W: {fqns}"
    entry = _straight_line(node, op)
    if entry is not None:
        return wrap_call(f"{indent}{writer.names[node]} = weight_grad.{entry}(", ["self", *positional],
                         comment, indent)
    pieces = ["self", writer._target(node.target),
              "(" + ", ".join(positional) + ("," if len(positional) == 1 else "") + ")"]
    if node.kwargs:
        pieces.append("{" + ", ".join(f"{k!r}: {writer._arg(v)}" for k, v in node.kwargs.items()) + "}")
    params = [writer.names[p] for p in op.params]
    pieces += [f"weights={op.weights!r}",
               "params=(" + ", ".join(params) + ("," if len(params) == 1 else "") + ")"]
    return wrap_call(f"{indent}{writer.names[node]} = weight_grad.deferred(", pieces, comment, indent)
