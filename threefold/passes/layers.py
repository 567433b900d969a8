"""Transformer layers found in the graph: module paths whose prefix repeats with an integer
index (`h.0.attn`, `h.1.mlp`, `model.layers.3.self_attn` -> layers `h.0`, `h.1`,
`model.layers.3`). Read by activation recomputation (one segment per layer) and by ZeRO-2/3
(one gradient bucket and one parameter unit per layer)."""
from __future__ import annotations

import re

import torch.fx as fx

from threefold.ir.program import tf

_INDEXED = re.compile(r"^\d+$")


def repeated_containers(nodes) -> set[str]:
    """Module-path prefixes 'a.b.<i>' whose container 'a.b' holds two or more indices."""
    indices: dict[str, set[str]] = {}
    for node in nodes:
        parts = (tf(node).get("module") or "").split(".")
        for i, part in enumerate(parts):
            if _INDEXED.match(part):
                indices.setdefault(".".join(parts[:i]), set()).add(part)
    return {c for c, idx in indices.items() if len(idx) >= 2}


def layer_key(node: fx.Node, containers: set[str]) -> str | None:
    """The outermost repeated layer this node belongs to ('h.3'), or None."""
    parts = (tf(node).get("module") or "").split(".")
    for i, part in enumerate(parts):
        if _INDEXED.match(part) and ".".join(parts[:i]) in containers:
            return ".".join(parts[:i + 1])
    return None


def layer_runs(graph: fx.Graph, containers: set[str]) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of consecutive compute nodes of one layer; nodes without a module path
    between two nodes of the same layer join it. No layer at all: the chunk is one run."""
    compute = [n for n in graph.nodes if n.op == "call_function"]
    runs: list[tuple[str, list[fx.Node]]] = []
    current, pending = None, []
    for node in compute:
        key = layer_key(node, containers)
        if key is None:
            pending.append(node)
            continue
        if runs and key == current:
            runs[-1][1].extend(pending)
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
        current, pending = key, []
    if not runs and compute:
        return [("<chunk>", compute)]
    seen: dict[str, int] = {}
    named = []
    for key, nodes in runs:   # a layer split into two runs: h.0, h.0#2
        seen[key] = seen.get(key, 0) + 1
        named.append((key if seen[key] == 1 else f"{key}#{seen[key]}", nodes))
    return named
