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

from threefold.compiler.program import Program, tf
from threefold.runtime import random_ops as rt

aten = torch.ops.aten

_DROPOUT = {"dropout", "tp_dropout"}
_RANDOM = {"bernoulli", "rand_like", "randn_like", "randint_like", "rand", "randn", "randint",
           "normal", "uniform", "randperm", "multinomial", "native_dropout", "feature_dropout",
           "alpha_dropout", "feature_alpha_dropout", "rrelu", "rrelu_with_noise"}
_SDPA = {"scaled_dot_product_attention"}
_TRAINING_ARG = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                 "feature_dropout": 2, "alpha_dropout": 2, "feature_alpha_dropout": 2,
                 "native_dropout": 2, "rrelu": 4, "rrelu_with_noise": 5}


def seed_random_ops(prog: Program) -> Program:
    """Needs: chunk graphs. Guarantees: no random op reads the default generator; no
    train-mode flag is a constant in a chunk graph."""
    index: dict[str, int] = {}
    for node in prog.graph.nodes:
        if node.op == "call_function" and _is_random(node):
            index.setdefault(node.name, len(index))
    for chunk in prog.chunks:
        if chunk.gm is None:
            continue
        changed = False
        for node in list(chunk.gm.graph.nodes):
            if node.op == "call_function":
                changed |= _rewrite(chunk.gm.graph, node, index)
        if changed:
            chunk.gm.graph.lint()
    return prog


def _short(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(node.target, "__name__", "")


def _is_random(node: fx.Node) -> bool:
    name = _short(node).rstrip("_")
    if name in _DROPOUT:
        return float(node.args[1]) != 0.0
    if name in _SDPA:
        return float(_dropout_p(node)) > 0.0
    return name in _RANDOM


def _dropout_p(node: fx.Node):
    if len(node.args) > 4:
        return node.args[4]
    return node.kwargs.get("dropout_p", 0.0)


def _sharded(node: fx.Node) -> bool:
    place = tf(node).get("placement")
    return place is not None and not str(place).startswith("R")


def _rewrite(graph: fx.Graph, node: fx.Node, index: dict[str, int]) -> bool:
    name = _short(node)
    base = name.rstrip("_")
    changed = False
    if base in _TRAINING_ARG and not name.startswith("_batch_norm_with"):
        i = _TRAINING_ARG[base]
        if i < len(node.args) and node.args[i] is True:
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
    if base in _DROPOUT:
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        train = rt.TrainFlag() if train is True else train
        node.target = rt.dropout
        node.args, node.kwargs = (x, p, train, ref), {}
        return True
    node.args = (ref, node.target) + tuple(node.args)
    node.target = rt.seeded
    return True
