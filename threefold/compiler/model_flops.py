"""Model FLOPs of one optimizer step, from the compiler's cost model (passes/cost.py).

Each op is counted once for the whole model: an op on tensor-parallel shards or partial
sums counts its local FLOPs times tp, a replicated one once; forward plus a backward of
twice the forward (the usual "model FLOPs": recomputation is not useful work), over every
microbatch and dp rank. Stored in the manifest (`model_flops`) for the training loop's
model FLOP/s.
"""
from __future__ import annotations

from threefold import placement as placements
from threefold.passes.cost import node_cost
from threefold.compiler.param_roles import stage_graphs
from threefold.ir.program import compute_nodes, meta_of, tf


def graph_model_flops(program) -> int:
    """Forward plus backward FLOPs of one optimizer step over the global batch."""
    plan = program.plan
    forward = 0
    for node in (n for g in stage_graphs(program) for n in compute_nodes(g)):
        flops = node_cost(node).flops
        if not flops:
            continue
        values = [a for a in node.all_input_nodes if meta_of(a) is not None
                  and not (a.op == "placeholder" and tf(a).get("kind") == "param")] + [node]
        split = any(placements.is_split(tf(v).get("placement")) for v in values)
        forward += flops * (plan.tp if split else 1)
    # the graph is one microbatch of one dp rank's share
    return 3 * forward * plan.microbatches * plan.dp
