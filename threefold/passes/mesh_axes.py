"""The batch axes' rules on the sharding walker (passes/shard.py): each value's entry for the
axes that split the batch (`node.meta["on_mesh"]`, threefold/placement.OnMesh), so that every
reader (BoundarySpec, the manifest's per-input and per-boundary placements, inspect, the memory
and checkpoint layouts) asks one function, `placement.on_mesh_of`:

  dp        where the batch is split (dp*m > 1), S(d) at the batch rows of every value the
            row rules follow (passes/row_rules.py, `ROWS`); user inputs from their batch dims.
            The `dp` alias (dp_replicate x dp_shard x ep) and the microbatches split these rows
  dp_shard  zero=3: a trainable parameter's rows over the dp_shard ranks
            (runtime/zero.split_rows cuts dim 0 of the tp-local tensor)

Neither refuses nor falls back: an op the row rules cannot follow loses the rows (whether that
is allowed is passes/batch_coupling.py's check, on the traced graph).
"""
from __future__ import annotations

from threefold.ir.program import tf
from threefold.ops.rules import Place
from threefold.passes.row_rules import propagate
from threefold.passes.row_state import LOST, Rows
from threefold.passes.shard import AxisRules
from threefold.placement import Shard

BATCH = "dp"   # the batch rows' entry: the alias of the axes that split the batch (runtime/mesh.py)


class BatchRows(AxisRules):
    """dp: the batch rows of every value, from the user inputs' batch dims through the row rules
    (where the traced rows are known; a rule that cannot follow a value loses it)."""
    axis = BATCH

    def size(self, stage) -> int:
        return stage.plan.dp

    def active(self, stage) -> bool:
        return bool(stage.batch_dims) and any(d is not None for d in stage.batch_dims)

    def seed(self, w, node):
        ann, dims = tf(node), w.stage.batch_dims
        if ann.get("kind") == "input" and ann["input_index"] < len(dims) and dims[ann["input_index"]] is not None:
            return Rows(dims[ann["input_index"]], 1)
        return None

    def decide(self, w, node):
        if not w.stage.micro_rows:
            return None
        try:
            state, _ = propagate(node, w.state, w.stage.micro_rows)
        except Exception:   # a rule that cannot read this node's arguments: stop tracking
            state = LOST
        return Place(state)

    def placement(self, s):
        return Shard(s.dim) if isinstance(s, Rows) else None


class ParameterRows(AxisRules):
    """dp_shard under zero=3: every trainable parameter's rows (dim 0)."""
    axis = "dp_shard"

    def size(self, stage) -> int:
        return stage.plan.shard_degree

    def active(self, stage) -> bool:
        return stage.plan.zero >= 3 and stage.plan.shard_degree > 1

    def seed(self, w, node):
        return tf(node).get("kind") == "param" and not tf(node).get("frozen")

    def placement(self, s):
        return Shard(0) if s is True else None


SHARDING = (BatchRows(), ParameterRows())
