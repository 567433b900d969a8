"""A toy axis's rules module (tests/test_shard_axis.py): the worked example of adding an axis.

`toy` splits the batch rows of a pointwise model: a user input is S(0) on it, an op ATen tags
pointwise keeps its sharded operand's placement, a full sum of a split value is a partial sum
(P), anything else is refused. Its rules are pure functions on the shared registry; its hooks
for the sharding walker (passes/shard.py) are one `AxisRules`.
"""
from __future__ import annotations

from threefold.ir.program import tf
from threefold.ops.families import op_name
from threefold.ops.rules import NoRule, Place, Refuse, Registry, refuse
from threefold.passes.shard import AxisRules
from threefold.placement import P, Shard

TOY = Registry("toy")
PARTIAL = "partial"


@TOY.rule(family="pointwise")
def _pointwise(call):
    """The output keeps the rows of its split operand (one of the output's rank: no broadcast over them)."""
    node, state = call
    out = node.meta["val"]
    dims = {state[a] for a in node.all_input_nodes if state.get(a) is not None}
    if PARTIAL in dims or len(dims) != 1:
        refuse("mixes a partial sum or two row layouts")
    for a in node.all_input_nodes:
        if state.get(a) is not None and a.meta["val"].dim() != out.dim():
            refuse("broadcasts its split operand")
    return next(iter(dims))


@TOY.rule("sum")
def _sum(call):
    node, state = call
    if node.args[1:] or node.kwargs.get("dim") is not None:
        refuse("sums along some dims only")
    return PARTIAL


class ToyAxis(AxisRules):
    axis = "toy"
    fix = "use toy=1"

    def active(self, stage) -> bool:
        return getattr(stage.plan, "toy", 1) > 1

    def seed(self, w, node):
        return 0 if tf(node).get("kind") == "input" else None

    def decide(self, w, node):
        if all(w.state.get(a) is None for a in node.all_input_nodes):
            return Place(None)
        d = TOY.decide(op_name(node), node, (node, w.state))
        if d is None:
            return Refuse("has no toy rule")
        return Refuse(d.why) if isinstance(d, NoRule) else Place(d)

    def placement(self, s):
        return P if s == PARTIAL else Shard(s) if isinstance(s, int) else None


SHARDING = (ToyAxis(),)
