"""Give every pipeline chunk a graph of its own.

Each chunk graph's placeholders come in a fixed order that codegen and the runtime share:
boundary values received (kind 'boundary'), user inputs read from the batch (kind 'input'),
then parameters and buffers (kinds 'param' and 'buffer', with their FQNs). Its output is a
tuple: the boundary values it sends on, or for the last chunk the model's outputs (the loss).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from threefold.compiler.program import Program, tf


def extract_chunks(prog: Program) -> Program:
    """Needs: prog.chunks from split_pipeline. Guarantees: chunk.gm for every chunk."""
    by_name = {n.name: n for n in prog.graph.nodes}
    graph_pos = {n: i for i, n in enumerate(prog.graph.nodes)}
    placeholders = [n for n in prog.graph.nodes if n.op == "placeholder"]
    input_ph = {tf(n)["input_index"]: n for n in placeholders if tf(n)["kind"] == "input"}
    state_ph = {tf(n)["fqn"]: n for n in placeholders if tf(n)["kind"] in ("param", "buffer")}
    for chunk in prog.chunks:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}

        def add_placeholder(src: fx.Node, kind: str):
            ph = g.placeholder(src.name)
            ph.meta["val"] = src.meta.get("val")
            ann = dict(tf(src))
            ann["kind"] = kind
            ph.meta["tf"] = ann
            env[src] = ph

        for name in chunk.inputs:
            add_placeholder(by_name[name], "boundary")
        for ph in sorted((input_ph[i] for i in chunk.user_inputs), key=graph_pos.__getitem__):
            add_placeholder(ph, "input")
        for ph in sorted((state_ph[f] for f in chunk.params + chunk.buffers), key=graph_pos.__getitem__):
            add_placeholder(ph, tf(ph)["kind"])
        recomputed = set(chunk.recomputed)
        body = sorted((by_name[x] for x in chunk.recomputed + chunk.nodes), key=graph_pos.__getitem__)
        for node in body:
            new = g.node_copy(node, lambda x: env[x])
            new.meta = dict(node.meta)
            new.meta["tf"] = dict(tf(node))
            if node.name in recomputed:
                new.meta["tf"]["recomputed"] = True
            env[node] = new
        g.output(tuple(env[by_name[x]] for x in chunk.outputs))
        g.lint()
        # Lazy: the fx Python code is only generated if someone calls the module (codegen
        # writes its own); on a 128-layer model this saves most of the pass's time.
        chunk.gm = _LazyGraphModule(torch.nn.Module(), g, class_name=f"Chunk{chunk.index}")
    return prog
