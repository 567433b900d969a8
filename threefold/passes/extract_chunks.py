"""Give every pipeline chunk a graph of its own (split_pipeline's last step).

Each chunk graph's placeholders come in a fixed order that codegen and the runtime share:
boundary values received (kind 'boundary'), user inputs read from the batch (kind 'input'),
then parameters and buffers (kinds 'param' and 'buffer', with their FQNs). Its output is a
tuple: the boundary values it sends on, or for the last chunk the model's outputs (the loss).
The whole graph is only read; every chunk graph is new, its nodes' meta copied.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from threefold.ir.program import tf
from threefold.ir.stages import BoundarySpec, Chunk


@dataclass
class ChunkCut:
    """Where a chunk lies in the whole graph, by node names (split_pipeline's decision)."""
    index: int
    nodes: list[str]                 # compute node names, in graph order
    inputs: list[str]                # boundary values received from the previous chunk
    outputs: list[str]               # boundary values sent to the next chunk (last: the loss)
    user_inputs: list[int]
    params: list[str]
    buffers: list[str]
    recomputed: list[str] = field(default_factory=list)


def extract_chunks(graph: fx.Graph, cuts: list[ChunkCut]) -> list[Chunk]:
    by_name = {n.name: n for n in graph.nodes}
    graph_pos = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    input_ph = {tf(n)["input_index"]: n for n in placeholders if tf(n)["kind"] == "input"}
    state_ph = {tf(n)["fqn"]: n for n in placeholders if tf(n)["kind"] in ("param", "buffer")}
    return [_extract(cut, by_name, graph_pos, input_ph, state_ph) for cut in cuts]


def _extract(cut: ChunkCut, by_name, graph_pos, input_ph, state_ph) -> Chunk:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def add_placeholder(src: fx.Node, kind: str):
        ph = g.placeholder(src.name)
        ph.meta["val"] = src.meta.get("val")
        ann = dict(tf(src))
        ann["kind"] = kind
        ph.meta["tf"] = ann
        if "on_mesh" in src.meta:   # its placement on every mesh axis (threefold/placement.OnMesh)
            ph.meta["on_mesh"] = src.meta["on_mesh"]
        env[src] = ph

    for name in cut.inputs:
        add_placeholder(by_name[name], "boundary")
    for ph in sorted((input_ph[i] for i in cut.user_inputs), key=graph_pos.__getitem__):
        add_placeholder(ph, "input")
    for ph in sorted((state_ph[f] for f in cut.params + cut.buffers), key=graph_pos.__getitem__):
        add_placeholder(ph, tf(ph)["kind"])
    recomputed = set(cut.recomputed)
    body = sorted((by_name[x] for x in cut.recomputed + cut.nodes), key=graph_pos.__getitem__)
    for node in body:
        new = g.node_copy(node, lambda x: env[x])
        new.meta = dict(node.meta)
        new.meta["tf"] = dict(tf(node))
        if node.name in recomputed:
            new.meta["tf"]["recomputed"] = True
        else:
            new.meta["tf"]["chunk"] = cut.index
        env[node] = new
    g.output(tuple(env[by_name[x]] for x in cut.outputs))
    g.lint()
    # Lazy: the fx Python code is only generated if someone calls the module (codegen
    # writes its own); on a 128-layer model this saves most of the pass's time.
    gm = _LazyGraphModule(torch.nn.Module(), g, class_name=f"Chunk{cut.index}")
    return Chunk(index=cut.index, gm=gm, nodes=tuple(cut.nodes),
                 inputs=tuple(BoundarySpec.of(by_name[x]) for x in cut.inputs),
                 outputs=tuple(BoundarySpec.of(by_name[x]) for x in cut.outputs),
                 user_inputs=tuple(cut.user_inputs), params=tuple(cut.params),
                 buffers=tuple(cut.buffers), recomputed=tuple(cut.recomputed))
