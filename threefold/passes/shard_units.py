"""ZeRO-2/3 units: the groups of parameters gathered and reduced together.

With `zero=3` (FSDP) a data-parallel rank stores 1/d of every parameter and all-gathers a
unit's parameters just before the unit's forward (and again before its backward), freeing
them after; with `zero>=2` a unit's gradients are reduce-scattered as soon as backward has
produced them. A unit is a transformer layer found in the graph (passes/layers.py: a
module path whose prefix repeats with an integer index), so the working set is about one
layer (two, with the next one prefetched). Everything else a chunk holds (embeddings, the
final norm, the head, and any parameter read by ops of more than one layer, such as a tied
weight) forms unit 0, gathered for the chunk's whole forward and backward window.

Guarantees: `chunk.units` is a tuple of `ShardUnit`s, unit 0 first, the rest in forward
order; every trainable parameter of the chunk is in exactly one unit (frozen ones in none:
they are kept whole). Empty when the plan shards no gradients (zero < 2).
"""
from __future__ import annotations

from dataclasses import dataclass

from threefold.ir.contracts import stage_pass
from threefold.ir.program import tf
from threefold.ir.stages import Partitioned
from threefold.passes.layers import layer_runs, repeated_containers

ROOT = "<chunk>"


@dataclass(frozen=True)
class ShardUnit:
    name: str                  # the layer's module path ('h.3'), or ROOT for unit 0
    params: tuple[str, ...]    # canonical FQNs, in the order the chunk's module declares them
    first: str = ""            # the unit's first compute node (codegen gathers before it)


@stage_pass(needs=Partitioned)
def plan_shard_units(prog: Partitioned) -> Partitioned:
    """Needs: chunk graphs. Guarantees: chunk.units under zero >= 2 (see the module doc)."""
    if prog.plan.zero < 2:
        return prog
    layers = repeated_containers(n for _, n in prog.chunk_nodes())
    chunks = tuple(c.evolve(units=chunk_units(c.gm.graph, layers)) for c in prog.chunks)
    return prog.evolve(chunks=chunks)


def chunk_units(graph, layers: set[str]) -> tuple[ShardUnit, ...]:
    trainable = [n for n in graph.nodes if n.op == "placeholder" and tf(n).get("kind") == "param"
                 and not tf(n).get("frozen")]
    runs = [(name, nodes) for name, nodes in layer_runs(graph, layers) if name != ROOT]
    run_of = {node: k for k, (_, nodes) in enumerate(runs) for node in nodes}
    home: dict[str, int] = {}          # FQN -> its layer run, or -1 (unit 0)
    for p in trainable:
        readers = {run_of.get(u, -1) for u in p.users}
        home[tf(p)["fqn"]] = readers.pop() if len(readers) == 1 else -1
    units = [ShardUnit(ROOT, tuple(f for f, k in home.items() if k == -1))]
    for k, (name, nodes) in enumerate(runs):
        params = tuple(f for f, h in home.items() if h == k)
        if params:
            units.append(ShardUnit(name, params, nodes[0].name))
    return tuple(units)
