"""Each mesh axis's entry in every value's placement (`node.meta["on_mesh"]`, threefold/placement.OnMesh).

The tensor-parallel pass writes the tp entry itself. The other axes' passes decide where a
value lies along them; this module turns those decisions into OnMesh entries, so that every
reader (BoundarySpec, the manifest's per-input and per-boundary placements, inspect, the
memory and checkpoint layouts) asks one function, `placement.on_mesh_of`, instead of a side
table per axis:

  cp        `place_sequence`: the context-parallel pass's sequence placements, S(d) along
            the sequence (a flattened [b*s, h] dim counts), P for a sum over this rank's tokens
  dp        `place_batch_axes`: where the batch is split (dp*m > 1), S(d) at the batch rows
            of every value the row rules follow (passes/row_rules.py); user inputs from their
            batch dims. The `dp` alias (dp_replicate x dp_shard x ep) and the microbatches
            split these rows
  dp_shard  `place_batch_axes`, zero=3: a trainable parameter's rows over the dp_shard ranks
            (runtime/zero.split_rows cuts dim 0 of the tp-local tensor)
  ep        `place_expert_axis`, ep > 1: an expert weight's experts (dim 0) and an expert
            region's rows, over the ep ranks (runtime/experts.py)
"""
from __future__ import annotations

import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.ir.program import tf
from threefold.ir.stages import Partitioned, Sharded, copy_graph_module
from threefold.passes.batch_coupling import row_states
from threefold.passes.cp_rules import PARTIAL, Seq
from threefold.passes.row_state import Rows
from threefold.placement import P, Shard, place_on

BATCH = "dp"   # the batch rows' entry: the alias of the axes that split the batch (runtime/mesh.py)


def place_sequence(gm: fx.GraphModule, placed: dict) -> None:
    """Write the cp entry of every value the sequence rules placed (`placed`: node name ->
    Seq | PARTIAL | None, passes/context_parallel.check_sequence)."""
    for node in gm.graph.nodes:
        p = placed.get(node.name)
        if isinstance(p, Seq):
            place_on(node, "cp", Shard(p.dim))
        elif p == PARTIAL:
            place_on(node, "cp", P)


@stage_pass(needs=Sharded, gives=Sharded)
def place_batch_axes(stage: Sharded) -> Sharded:
    """Needs: the sharded graph and the user inputs' batch dims. Guarantees: where the batch is
    split, every value with batch rows the row rules follow has its `dp` entry (S(batch dim)),
    and under zero=3 every trainable parameter its `dp_shard` entry (S(0))."""
    plan = stage.plan
    split = bool(stage.batch_dims) and any(d is not None for d in stage.batch_dims)
    rows_sharded = plan.zero >= 3 and plan.shard_degree > 1
    if not split and not rows_sharded:
        return stage.evolve()
    gm = copy_graph_module(stage.gm)
    if split:
        states = _batch_rows(gm.graph, stage.batch_dims, stage.micro_rows)
        for node, state in states.items():
            if isinstance(state, Rows):
                place_on(node, BATCH, Shard(state.dim))
    if rows_sharded:
        for node in gm.graph.nodes:
            if node.op == "placeholder" and tf(node).get("kind") == "param" and not tf(node).get("frozen"):
                place_on(node, "dp_shard", Shard(0))
    return stage.evolve(gm=gm)


def _batch_rows(graph: fx.Graph, batch_dims: list, rows: int | None) -> dict:
    """Each node's row state: the user inputs' from their batch dims, the others' from the
    row rules where the traced rows are known (a rule that cannot follow a value loses it)."""
    if rows:
        return row_states(graph, batch_dims, rows)[0]
    return {n: Rows(batch_dims[tf(n)["input_index"]]) for n in graph.nodes
            if n.op == "placeholder" and tf(n).get("kind") == "input"
            and tf(n)["input_index"] < len(batch_dims) and batch_dims[tf(n)["input_index"]] is not None}


@stage_pass(needs=Partitioned)
def place_expert_axis(prog: Partitioned) -> Partitioned:
    """Needs: chunk graphs with their expert regions (passes/experts.py). Guarantees (ep > 1):
    every expert weight (its parameter and the views the region reads) and every value of an
    expert region has its `ep` entry, S(0): the experts, or the rows sorted by expert."""
    if getattr(prog.plan, "ep", 1) == 1 or not any(c.experts for c in prog.chunks):
        return prog.evolve()
    params = {f for c in prog.chunks for r in c.experts for f in r["params"]}   # wherever they are held
    chunks = []
    for chunk in prog.chunks:
        gm = copy_graph_module(chunk.gm)
        by_name = {n.name: n for n in gm.graph.nodes}
        for node in gm.graph.nodes:
            if node.op == "placeholder" and tf(node).get("fqn") in params:
                place_on(node, "ep", Shard(0))
        for r in chunk.experts:
            for name in list(r["weights"]) + list(r["nodes"]):
                if name in by_name:
                    place_on(by_name[name], "ep", Shard(0))
        chunks.append(chunk.evolve(gm=gm))
    return prog.evolve(chunks=tuple(chunks))
