"""Activation recomputation: which ops of each chunk are recomputed in backward.

`plan.recompute`:
  full       one segment per transformer layer: backward keeps only the layer's inputs and
             runs the layer's forward again (Megatron's full recomputation). Layers are found
             in the graph: a module path whose prefix repeats with an integer index
             (`h.0.attn`, `h.1.mlp`, `model.layers.3.self_attn` -> `h.0`, `h.1`, `model.layers.3`)
             across the whole program. A chunk with no such structure is one segment.
  selective  inside each layer (or chunk), the regions that keep many bytes for few FLOPs:
             values larger than the layer's output (the attention scores, a*s*s per sequence,
             against s*h) grown into a connected region with the ops that consume them, kept
             when the region's share of the layer's saved bytes exceeds its share of the
             layer's FLOPs (it frees memory at a better rate than the layer's average). In a
             GPT that is the attention core (scores, mask, softmax, dropout, scores x V); the
             MLP's 4h activations fail the rule (their GEMMs are most of the layer's FLOPs).

Guarantees: `chunk.recompute` is a tuple of segments {"name", "nodes" (contiguous
compute nodes in graph order), "why"}; codegen writes each as a method run under
`torch.utils.checkpoint` (ChunkModule.recompute). A segment that writes in place into a value
it does not create (recomputing it would write twice) or whose result is not a tensor is
left out, with a reason in prog.notes.
"""
from __future__ import annotations

import torch.fx as fx

from threefold.passes.cost import NodeCost, node_cost
from threefold.ir.contracts import stage_pass
from threefold.ir.program import meta_of, tf
from threefold.ir.stages import Partitioned
from threefold.passes.layers import layer_runs, repeated_containers


@stage_pass(needs=Partitioned, guarantees=("recompute",))
def plan_recompute(prog: Partitioned) -> Partitioned:
    """Needs: chunk graphs, costs. Guarantees: chunk.recompute (segments) per chunk."""
    mode = getattr(prog.plan, "recompute", "none")
    layers = repeated_containers(n for _, n in prog.chunk_nodes())
    chunks, notes = [], []
    for chunk in prog.chunks:
        segments = []
        if mode != "none":
            for name, nodes in layer_runs(chunk.gm.graph, layers):
                if mode == "full":
                    why = ("full: keeps the layer's inputs, recomputes its ops in backward"
                           if name != "<chunk>" else "full: no repeated layers in the graph; "
                           "keeps the chunk's inputs, recomputes the chunk in backward")
                    segments.append({"name": name, "nodes": [n.name for n in nodes], "why": why})
                else:
                    segments += _selective(name, nodes)
        kept = []
        for seg in segments:
            problem = _unsafe(chunk.gm.graph, seg["nodes"])
            if problem:
                notes.append(f"recompute: chunk {chunk.index} keeps {seg['name']} (not recomputed): {problem}")
            else:
                kept.append(seg)
        chunks.append(chunk.evolve(recompute=tuple(kept)))
    return prog.evolve(chunks=tuple(chunks), notes=prog.notes + tuple(notes))


# --- selective ----------------------------------------------------------------------------
def _cost(node: fx.Node) -> NodeCost:
    return tf(node).get("cost") or node_cost(node)


def _numel(node) -> int:
    m = meta_of(node) if isinstance(node, fx.Node) else None
    return m.numel if m is not None else 0


def _saved(nodes: list[fx.Node], produced: set[str] | None = None) -> int:
    """Bytes autograd keeps for these ops (each value once); only values produced inside
    `produced` when given: those are what recomputing the nodes frees."""
    kept: dict[str, int] = {}
    for n in nodes:
        for value, nbytes in _cost(n).saved:
            if produced is None or value.split(".mask")[0] in produced:
                kept[value] = nbytes
    return sum(kept.values())


def _selective(layer: str, nodes: list[fx.Node]) -> list[dict]:
    """Regions of the layer that free more of its saved bytes than they cost of its FLOPs."""
    inside = set(nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    # The residual stream: the largest floating value the layer hands on (its output); not
    # its inputs, which may include a (b, 1, s, s) attention mask as large as the scores.
    handed_on = [n for n in nodes if any(u not in inside for u in n.users)]
    floats = [_numel(n) for n in handed_on if meta_of(n) is not None and meta_of(n).dtype.is_floating_point]
    reference = max(floats, default=0)
    if reference == 0:
        return []
    large = [n for n in nodes if _numel(n) > reference]
    layer_saved, layer_flops = _saved(nodes), sum(_cost(n).flops for n in nodes)
    if not large or not layer_saved or not layer_flops:
        return []
    # Connected regions of large values, each with the ops that read them (so the large
    # values are internal: recomputed, not kept).
    region_of: dict[fx.Node, int] = {}
    regions: list[set[fx.Node]] = []
    for n in large:
        linked = {region_of[a] for a in n.all_input_nodes if a in region_of}
        if linked:
            target = min(linked)
            for other in sorted(linked - {target}):
                regions[target] |= regions[other]
                for m in regions[other]:
                    region_of[m] = target
                regions[other] = set()
        else:
            target = len(regions)
            regions.append(set())
        regions[target].add(n)
        region_of[n] = target
    out = []
    for region in regions:
        if not region:
            continue
        members = set(region) | {u for n in region for u in n.users if u in inside}
        lo, hi = min(pos[n] for n in members), max(pos[n] for n in members)
        span = nodes[lo:hi + 1]
        # What recomputing frees: values made inside the span that ops inside it keep,
        # minus the span's results that live on outside anyway.
        in_span = set(span)
        results = {n.name for n in span if any(u not in in_span for u in n.users)}
        freed = _saved(span, {n.name for n in span} - results)
        flops = sum(_cost(n).flops for n in span)
        if freed and freed / layer_saved > flops / layer_flops:
            out.append({"name": f"{layer}:{span[0].name}..{span[-1].name}", "nodes": [n.name for n in span],
                        "why": f"selective: frees {freed / layer_saved:.0%} of the layer's saved bytes "
                               f"for {flops / layer_flops:.1%} of its FLOPs"})
    return out


# --- safety -------------------------------------------------------------------------------
def _unsafe(graph: fx.Graph, names: list[str]) -> str | None:
    by_name = {n.name: n for n in graph.nodes}
    nodes = [by_name[x] for x in names]
    inside = set(nodes)
    if not any(u not in inside for n in nodes for u in n.users):
        return "nothing outside it reads its results"
    for n in nodes:
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            for i, a in enumerate(schema.arguments):
                value = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                if a.alias_info is not None and a.alias_info.is_write and isinstance(value, fx.Node) \
                        and value not in inside:
                    return f"{n.name} writes in place into {value.name}, made outside the segment"
        if any(u not in inside for u in n.users):
            val = n.meta.get("val")
            if not hasattr(val, "shape"):
                return f"its result {n.name} is not a tensor"
    return None
