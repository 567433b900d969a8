"""The last chunk's `model_outputs` method: what `pm(x)` returns for a model compiled with a loss.

With a loss, the last chunk's forward returns only the loss (a numerator, in its local
tensor-parallel layout: vocab-parallel logits never leave their shard). For forward-only
inference the same chunk also gets a second method computing the model's own outputs (the
values the trace recorded as the loss_fn's input, `prog.model_outputs`) from the same
arguments, and bringing sharded ones back whole: a shard is all-gathered (and trimmed of
vocabulary padding), a partial sum all-reduced. Those collectives live only in this
method, which training never calls, so a training step moves no extra byte.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold import placement as placements
from threefold.ir.program import tf
from threefold.runtime import tp_ops

aten = torch.ops.aten


def missing_reason(prog) -> str:
    """Why pm(x) cannot return the model's outputs for this program ('' when it can): the
    manifest carries it, so every rank refuses alike before any rank starts a pipeline."""
    if not prog.has_loss:
        return ""
    if not prog.model_outputs:
        return "the traced model returned no tensor outputs"
    g = model_outputs_graph(prog.chunks[-1].gm, prog.model_outputs, prog.model_output_meta, prog.plan.tp)
    return g if isinstance(g, str) else ""


def model_outputs_graph(gm: fx.GraphModule, names: list, metas: list, tp: int) -> fx.Graph | str:
    """A graph over the chunk's own placeholders that returns the model's outputs whole,
    or a one-line reason why this chunk cannot (an output the loss never reads, or one
    computed only on an earlier stage)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, name in enumerate(names):
        if name is None:
            return (f"model output {i} is not read by the loss_fn, so the compiled graph does not "
                    "compute it; parallelize without loss_fn to get every output")
        if name not in nodes:
            return (f"model output {i} ({name}) is not available on the last pipeline chunk (the cut "
                    "falls between it and the loss); move the cut with split=... in the plan")
    wanted: set[fx.Node] = set()
    stack = [nodes[n] for n in names]
    while stack:
        n = stack.pop()
        if n not in wanted:
            wanted.add(n)
            stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        # every received value stays an argument (the engine passes all of them)
        keep = n in wanted or (n.op == "placeholder" and tf(n).get("kind") == "boundary")
        if n.op == "output" or not keep:
            continue
        new = g.node_copy(n, env.__getitem__)
        new.meta = dict(n.meta)
        new.meta["tf"] = dict(tf(n))
        env[n] = new
    outs = []
    for name, meta in zip(names, metas):
        node = env[nodes[name]]
        whole = _whole(g, node, placements.parse(tf(nodes[name]).get("placement")), meta, tp)
        if isinstance(whole, str):
            return f"model output {name} {whole}"
        outs.append(whole)
    g.output(tuple(outs))
    g.lint()
    return g


def _whole(g: fx.Graph, node: fx.Node, placement, meta, tp: int) -> fx.Node | str:
    """`node` brought to its full value on every tp rank (placement: the TP pass's)."""
    if tp == 1 or isinstance(placement, placements.Replicate):
        return node
    local = node.meta.get("val")
    if not isinstance(local, torch.Tensor):
        return "is not a tensor"
    if isinstance(placement, placements.Partial):
        return _call(g, tp_ops.g, (node, tp_ops.TP), node, local.shape)
    if not isinstance(placement, placements.Shard):
        return f"has placement {placement}, which forward-only output cannot gather"
    dim, blocks = placement.dim, list(placement.blocks)
    shape = list(local.shape)
    shape[dim] = sum(blocks) if blocks else shape[dim] * tp
    if blocks:
        return _call(g, tp_ops.gather_blocks, (node, dim, blocks, tp_ops.TP), node, shape)
    out = _call(g, tp_ops.gather, (node, dim, tp_ops.TP), node, shape)
    full = meta.shape[dim] if meta is not None else shape[dim]
    if shape[dim] != full:   # vocabulary padding
        shape[dim] = full
        out = _call(g, aten.slice.Tensor, (out, dim, 0, full), node, shape)
    return out


def _call(g: fx.Graph, target, args, like: fx.Node, shape) -> fx.Node:
    n = g.call_function(target, args)
    n.meta["tf"] = {"module": tf(like).get("module", ""), "placement": "R"}
    n.meta["val"] = torch.empty(list(shape), dtype=like.meta["val"].dtype, device="meta")
    return n
