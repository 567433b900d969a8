"""Numbers computed from the token count, beside counts over the whole batch (plan `cp=N`).

A scan or sort over the tokens of the whole batch (the batch and sequence flattened into one
dim: an expert capacity queue, `place = cumsum(one_hot(expert), 0)`) runs on the all-gathered
tokens (passes/cp_fallback.py) and is cut back to this rank's tokens: each holds its place in
the whole batch's queue, as in one process. The model then compares it with a number it
computed from the traced token count (`capacity = ceil(factor * N * k / E)`, a Python int:
a constant of the graph, baked at the local N in cp's trace). One process uses the number of
the whole batch: the same op in the model traced at the whole length (stage.retrace, its twin
by name) holds it.

So every element-wise op that reads a value computed from such a scan (by data flow: `COUNTS`
travels from the scan's output to everything computed from it) takes the scalar arguments of
its twin at the whole length, where the twin is the same op on values of the whole shapes
(each tensor argument's dims those of this rank's, or cp times them). An element-wise op's
scalar is a value, never a shape, so the twin's is the number one process computes with;
where they agree nothing changes. Where the twin cannot be found or differs otherwise, the
op is refused in one line naming why: a number it reads may be the local count.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ops.families import is_pointwise
from threefold.passes.cp_whole import TWIN, twin_named

COUNTS = "cp_whole_counts"   # meta: computed from a scan or sort over the whole batch's tokens


def mark_counts(node: fx.Node) -> None:
    node.meta[COUNTS] = True


def reads_counts(node: fx.Node) -> bool:
    return any(a.meta.get(COUNTS) for a in node.all_input_nodes)


def whole_scalars(node: fx.Node, stage, why: str) -> None:
    """`node` reads a value computed from counts over the whole batch: it carries COUNTS on, and
    an element-wise op takes its twin's scalar arguments (or a one-line PlanError `why`)."""
    mark_counts(node)
    if not is_pointwise(node) or not _scalars(node) or not _of_model(node):
        return   # cp's own ops (a cut back, its arithmetic) hold cp's numbers
    twin = twin_named(node, stage)
    if twin is None or twin.target != node.target or len(twin.args) != len(node.args) \
            or set(twin.kwargs) != set(node.kwargs):
        raise PlanError(f"{why} (it reads a count over the tokens of the whole batch beside a number that may be "
                        "computed from this rank's token count, and the model traced at the whole length has no "
                        "such op to read one process's number from)")
    pairs = [(x, y) for x, y in zip(node.args, twin.args)] + [(node.kwargs[k], twin.kwargs[k]) for k in node.kwargs]
    for x, y in pairs:
        if isinstance(x, fx.Node) != isinstance(y, fx.Node) or (_number(x) != _number(y)) \
                or (isinstance(x, fx.Node) and not _same_value(x, y, stage.plan.cp)) \
                or (not isinstance(x, fx.Node) and not _number(x) and x != y):
            raise PlanError(f"{why} (it reads a count over the tokens of the whole batch, and its op in the model "
                            "traced at the whole length differs otherwise: cp cannot tell which number one process "
                            "uses)")
    node.args = tuple(y if _number(y) else x for x, y in zip(node.args, twin.args))
    node.kwargs = {k: (twin.kwargs[k] if _number(twin.kwargs[k]) else v) for k, v in node.kwargs.items()}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalars(node: fx.Node) -> bool:
    return any(_number(v) for v in list(node.args) + list(node.kwargs.values()))


def _of_model(x: fx.Node) -> bool:
    """x is an op of the model's trace (export's metadata, or a copy of one: TWIN), not one cp built."""
    return TWIN in x.meta or "stack_trace" in x.meta or "tensor_meta" in x.meta


def _same_value(x: fx.Node, twin: fx.Node, cp: int) -> bool:
    """twin, the argument of node's twin where node reads x, is x's value at the whole length: the
    same op of the model (by name) unless cp built x, and x's shape with each dim as it is or cp
    times it."""
    if _of_model(x) and twin.name != x.meta.get(TWIN, x.name):
        return False
    a, b = x.meta.get("val"), twin.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)
    return a.dim() == b.dim() and all(q in (p, p * cp) for p, q in zip(a.shape, b.shape))
