"""Random ops get their own seeds; train/eval-dependent arguments follow the module's mode.

Needs chunk graphs (after extract_chunks and fuse). Each random op of the program gets an
index (its position among the program's random ops, so a free op recomputed in two chunks
keeps one index and draws one mask); the op becomes a runtime call seeded per (step,
microbatch, index) and, on tensor-parallel shards, per tp rank (runtime/random_ops.py).
Arguments the trace baked for train mode (dropout's `train`, batch norm's `training`,
SDPA's `dropout_p`) become `self.training`-dependent in generated code.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold import placement
from threefold.ir.contracts import stage_pass
from threefold.ops import families as fam
from threefold.ir.program import tf
from threefold.ir.stages import Partitioned, copy_graph_module
from threefold.runtime import random_ops as rt

aten = torch.ops.aten

_SDPA = {"scaled_dot_product_attention"}
def _train_index(node: fx.Node) -> int | None:
    """The position of the op's train-mode argument, read from its schema (counted by hand,
    rrelu's and rrelu_with_noise's were one off, so their flag stayed True in eval)."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    return next((i for i, a in enumerate(names) if a in ("training", "train")), None)


@stage_pass(needs=Partitioned)
def seed_random_ops(stage: Partitioned) -> Partitioned:
    """Needs: chunk graphs. Guarantees: no random op reads the default generator; no
    train-mode flag is a constant in a chunk graph. Random ops are numbered in the traced
    graph's order (a free op copied into several chunks keeps one number); chunks with
    something to rewrite get a rewritten copy of their graph."""
    pos = {name: i for i, name in enumerate(stage.source_order)}
    random = {n.name for _, n in stage.chunk_nodes() if n.op == "call_function" and _is_random(n)}
    index = {name: i for i, name in enumerate(sorted(random, key=lambda x: pos.get(x, len(pos))))}
    chunks = []
    for chunk in stage.chunks:
        if not any(_to_rewrite(n, index) for n in chunk.gm.graph.nodes):
            chunks.append(chunk)
            continue
        gm = copy_graph_module(chunk.gm)
        for node in list(gm.graph.nodes):
            if node.op == "call_function":
                _rewrite(gm.graph, node, index)
        gm.graph.lint()
        chunks.append(chunk.evolve(gm=gm))
    return stage.evolve(chunks=tuple(chunks))


def _to_rewrite(node: fx.Node, index: dict[str, int]) -> bool:
    """_rewrite would change this node (a random op, a train flag, SDPA dropout)."""
    if node.op != "call_function":
        return False
    base = _short(node).rstrip("_")
    return node.name in index or base in fam.TRAIN_FLAGGED or base in _SDPA


def _short(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(node.target, "__name__", "")


def _is_random(node: fx.Node) -> bool:
    name = _short(node).rstrip("_")
    if name in fam.DROPOUTS:
        return float(node.args[1]) != 0.0
    if name in _SDPA:
        return float(_dropout_p(node)) > 0.0
    return name in fam.SEEDED_RANDOM


def _dropout_p(node: fx.Node):
    if len(node.args) > 4:
        return node.args[4]
    return node.kwargs.get("dropout_p", 0.0)


def _sharded(node: fx.Node) -> bool:
    return placement.is_split(tf(node).get("placement"))


def _rewrite(graph: fx.Graph, node: fx.Node, index: dict[str, int]) -> bool:
    name = _short(node)
    base = name.rstrip("_")
    changed = False
    if base in fam.TRAIN_FLAGGED and not name.startswith("_batch_norm_with"):
        i = _train_index(node)
        if i is not None and i < len(node.args) and node.args[i] is True:
            args = list(node.args)
            args[i] = rt.TrainFlag()
            node.args = tuple(args)
            changed = True
    if base in _SDPA and float(_dropout_p(node)) > 0.0:
        p = _dropout_p(node)
        if len(node.args) > 4:
            args = list(node.args)
            args[4] = rt.TrainValue(p, 0.0)
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "dropout_p": rt.TrainValue(p, 0.0)}
        changed = True
    if node.name not in index:
        return changed
    ref = rt.RngRef(index[node.name], _sharded(node) or base == "tp_dropout")
    if base in fam.DROPOUTS:
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        train = rt.TrainFlag() if train is True else train
        node.target = rt.dropout
        node.args, node.kwargs = (x, p, train, ref), {}
        return True
    node.args = (ref, node.target) + tuple(node.args)
    node.target = rt.seeded
    return True
