"""`model_cost_from_spec`: the planner's `ModelCost` from a traced and tensor-parallel program.

The SPEC's model is traced once at its example batch (on the meta device if the factory
builds it there). The repeated blocks are found from module paths: the `prefix.<i>` family
with the most members (`h.0`, `h.1`, ...) is the layer stack. Block 0's nodes become the
per-layer ops, nodes before the first block the `pre` part, nodes after the last block the
`post` part.

How each op maps to tensor parallelism is the compiler's decision, not a guess: the
tensor-parallel pass runs at a trial degree t (`tp_decisions.py`), every op of its output is
costed on local shapes by `passes/cost.py`, and an op whose activations are held as
shards or partial sums (placements S and P) is split over tp (its local cost times t is
the whole op's), any other runs whole on every rank. Parameters are sharded exactly when
the pass cuts them (`shard_fns`); the tp all-reduces of a layer are the forward all-reduces
the pass inserted into block 0; tp must divide every size the pass split there. Decisions
that depend on t itself (a GQA projection kept whole when t does not divide its heads)
are those of the trial degree. Bytes are rescaled from the traced dtype to 16-bit training.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import torch
import torch.fx as fx

from threefold.passes import cost as cost_mod
from threefold.ir.program import compute_nodes, meta_of, tf
from threefold.ir.stages import Program
from threefold.errors import PlanError
from threefold.ops import families as fam
from threefold.planner import tp_decisions as tpd
from threefold.planner.model_cost import ACT_BYTES, ModelCost, Op, cross_entropy_bytes
from threefold.ir.stages import copy_graph_module
from threefold.passes.experts import expert_regions

# the loss over a row of logits (vocab-parallel under tp): priced by model_cost.cross_entropy_bytes
LOSS_OPS = fam.CROSS_ENTROPIES | fam.VOCAB_PARALLEL_CROSS_ENTROPIES
# lookups of rows of a parameter table by index (the embedding, under tp its vocab-parallel form)
GATHER_OPS = fam.EMBEDDINGS
MATMUL_OPS = fam.GEMMS | fam.ATTENTION | fam.CONV_CALLS


def model_cost_from_spec(spec: str, progress=None) -> ModelCost:
    """ModelCost of the workload a SPEC names; PlanError when it cannot be derived.
    `progress(stage)` hears "load SPEC", "trace" and "cost" as each starts."""
    try:
        # lazy: start-up: the compiler loads only when a SPEC is costed
        from threefold.compiler.trace import trace
        # lazy: start-up: the SPEC loader runs only when a SPEC is costed
        from threefold.workload import load_spec
    except ImportError as exc:
        raise PlanError(f"SPEC models need the tracer and cost model (threefold.compiler.trace/cost), "
                        f"which are not available ({exc}): describe the model with --layers --hidden "
                        "--heads --vocab --seq instead") from None
    tell = progress or (lambda stage: None)
    tell("load SPEC")
    work = load_spec(spec)
    tell("trace")
    traced = trace(work.model, work.inputs, work.target, work.loss_fn)
    tell("cost (tensor-parallel trial, saved activations)")
    return model_cost_from_program(traced, work.inputs, spec)


def model_cost_from_program(traced: Program, inputs: tuple, name: str) -> ModelCost:
    """ModelCost of a traced Program whose example inputs were `inputs`."""
    first = inputs[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 1:
        raise PlanError(f"SPEC {name!r}: the first input is not a batched tensor; the planner needs "
                        "(batch, seq, ...) inputs to count tokens")
    seq = int(first.shape[1]) if first.dim() >= 2 else 1
    tokens = int(first.shape[0]) * seq

    # -- structure, from the traced (global) graph ----------------------------------------
    nodes = compute_nodes(traced.graph)
    families: dict[str, set] = defaultdict(set)
    for n in nodes:
        m = re.match(r"^(.*?)\.?(\d+)(?:\.|$)", tf(n).get("module", "") or "")
        if m:
            families[m.group(1)].add(int(m.group(2)))
    if not families or max(len(v) for v in families.values()) < 2:
        raise PlanError(f"SPEC {name!r}: no repeated blocks found (module paths like 'h.0', 'h.1'); the "
                        "planner models a stack of identical layers: describe it with --layers --hidden ...")
    prefix = max(families, key=lambda k: len(families[k]))
    pattern = re.compile(rf"^{re.escape(prefix)}\.?(\d+)(?:\.|$)")
    groups = _groups(nodes, pattern)
    indices, block0, block1 = groups["indices"], groups["block0"], {n.name for n in groups["block1"]}
    # The boundary: what block 1 reads from outside itself (the residual stream).
    boundary = {a.name: meta_of(a) for n in nodes if n.name in block1 for a in n.all_input_nodes
                if a.name not in block1 and a.op == "call_function" and meta_of(a) is not None}
    if not boundary:
        raise PlanError(f"SPEC {name!r}: cannot find the tensor passed between blocks {prefix}.0 and {prefix}.1")
    bmeta = max(boundary.values(), key=lambda m: m.numel)
    param_elt = max((t.element_size() for t in traced.state.values() if t.is_floating_point()), default=4)
    scale = ACT_BYTES / param_elt

    # -- tensor parallelism, from the compiler's pass ---------------------------------------
    sharded, t = tpd.shard_program(traced)
    split_params = tpd.sharded_params(sharded)
    # ops are priced as the kernels a GPU run executes: the fusion pass's regions (each one
    # kernel that reads its inputs and writes its outputs once), as the shape flags price
    # Megatron's fused kernels (gpt_cost.py); saved activations stay the unfused graph's
    fused = _fused_graph(sharded.gm)
    local = _groups([n for n in compute_nodes(fused.graph) if not tpd.is_communication(n)], pattern)
    block0_all = [n for n in compute_nodes(sharded.graph) if _layer(n, pattern) == indices[0]]
    costing = _Costing(t, tokens, scale, split_params)

    def params_of(group) -> dict:
        out = {}
        for n in group:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and tf(a).get("kind") == "param":
                    out[tf(a)["fqn"]] = traced.state[tf(a)["fqn"]]
        return out

    layer_params, pre_params, post_params = (params_of(groups[k]) for k in ("block0", "pre", "post"))
    # a mixture of experts in block 0 (planner/spec_moe.py): its experts are priced by
    # planner/moe.py (E/ep per rank, GEMMs and all-to-alls), not as the block's own ops
    # lazy: start-up: threefold.planner.spec_moe loads 2 more modules only when this runs
    from threefold.planner.spec_moe import block_moe
    moe, expert_fqns, expert_nodes = block_moe(traced, block0, tokens)
    if moe is not None:   # the same regions in the sharded graph (tp renames a row-parallel GEMM)
        expert_nodes = expert_nodes | {name for r in expert_regions(sharded.graph) for name in r["nodes"]}
    layer_params = {f: p for f, p in layer_params.items() if f not in expert_fqns}
    tied = {f for group in traced.ties.values() for f in group} | set(traced.ties)
    tied_embedding = any(f in tied for f in pre_params) and any(f in tied for f in post_params)
    untied_post = {f: p for f, p in post_params.items() if f not in tied}

    def numel(params: dict, split: bool) -> float:
        return float(sum(p.numel() for f, p in params.items() if (f in split_params) == split))

    allreduces = [tpd.forward_allreduces(n) for n in block0_all]
    count = sum(k for k, _ in allreduces)
    divides: set[int] = {1} if t == 1 else set()
    for n in local["block0"]:
        divides |= tpd.shard_sizes(n, t)
    for fqn in layer_params:
        spec = split_params.get(fqn)
        if spec is not None:
            divides |= set(spec.blocks) or {int(traced.state[fqn].shape[spec.dim])}
    # Saved activations as autograd keeps them (planner/saved_bytes.py), with and without the
    # recompute pass's selective choice for block 0 (passes/recompute.py's own rule).
    # lazy: start-up: threefold.passes.recompute loads 2 more modules only when this runs
    from threefold.passes.recompute import _selective
    selective = [seg["nodes"] for seg in _selective(f"{prefix}.{indices[0]}", block0_all)]
    kept_graph = _GraphSaved(sharded.gm, t, scale, tokens)
    saved_split, saved_repl = kept_graph.per_token([n.name for n in block0_all])
    sel_split, sel_repl = kept_graph.per_token([n.name for n in block0_all], selective)
    post_split, post_repl = kept_graph.per_token([n.name for n in local["post"]])
    rerun = {name for seg in selective for name in seg}
    cost = ModelCost(
        name=name, layers=len(indices), seq_len=seq,
        layer_ops=tuple(dataclasses.replace(op, selective=True) if _members(n) & rerun else op
                        for n in local["block0"] if n.name not in expert_nodes and (op := costing.op(n)) is not None),
        pre_ops=costing.ops(local["pre"]),
        post_ops=costing.ops(local["post"]),
        layer_params=float(sum(p.numel() for p in layer_params.values())),
        layer_params_repl=numel(layer_params, split=False),
        pre_params=numel(pre_params, split=True), pre_params_repl=numel(pre_params, split=False),
        post_params=numel(untied_post, split=True), post_params_repl=numel(untied_post, split=False),
        tied_embedding=tied_embedding,
        tp_allreduce_bytes=sum(k * e for k, e in allreduces) * ACT_BYTES / tokens,
        tp_allreduces_per_layer=max(1, count),
        boundary_bytes=bmeta.nbytes * scale / tokens,
        act_split=saved_split, act_repl=saved_repl, act_input=bmeta.nbytes * scale / tokens,
        act_selective_split=sel_split, act_selective_repl=sel_repl,
        post_act=post_split + post_repl,
        tp_divides=tuple(sorted(divides)),
    )
    if moe is None:
        return cost
    expert_flops = 2 * 3 * moe.hidden * moe.ffn * moe.top_k   # per token per layer, forward

    def flops(batch: int, recompute: bool) -> float:
        return (cost.flops_per_iteration(batch, recompute)
                + batch * seq * cost.layers * expert_flops * (4 if recompute else 3))
    return dataclasses.replace(cost, moe=moe, flops_per_iteration_fn=flops)


def _members(node: fx.Node) -> set[str]:
    """The traced nodes a (fused) node stands for: a fused region's members, else itself."""
    return set(getattr(node.target, "source_nodes", None) or ()) | {node.name}


def _fused_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the sharded graph with the fusion pass's regions (passes/fusion.py) made one
    node each, as codegen runs them on a GPU."""
    # lazy: start-up: threefold.passes.fusion loads 4 more modules only when this runs
    from threefold.passes.fusion import fuse_graph
    copy = copy_graph_module(gm)
    fuse_graph(copy)
    return copy


def _layer(node: fx.Node, pattern: re.Pattern) -> int | None:
    m = pattern.match(tf(node).get("module", "") or "")
    return int(m.group(1)) if m else None


def _groups(nodes, pattern) -> dict:
    """Split graph-ordered nodes into block 0, block 1, before the first block and after the last."""
    layer_of = {n.name: _layer(n, pattern) for n in nodes}
    in_layers = [i for i, n in enumerate(nodes) if layer_of[n.name] is not None]
    indices = sorted({layer_of[nodes[i].name] for i in in_layers})
    first, last = min(in_layers), max(in_layers)
    return {
        "indices": indices,
        "block0": [n for n in nodes if layer_of[n.name] == indices[0]],
        "block1": [n for n in nodes if layer_of[n.name] == indices[1]],
        "pre": [n for n in nodes[:first] if layer_of[n.name] is None],
        "post": [n for n in nodes[last + 1:] if layer_of[n.name] is None],
    }


class _Costing:
    """Local (per-tp-rank) node costs turned into the model's split/replicated per-token figures."""

    def __init__(self, t: int, tokens: int, scale: float, split_params: dict):
        self.t, self.tokens, self.scale, self.split_params = t, tokens, scale, split_params

    def _activations(self, node: fx.Node) -> list[fx.Node]:
        tensors = [a for a in _flat_nodes((node.args, node.kwargs)) if meta_of(a) is not None
                   and not (a.op == "placeholder" and tf(a).get("kind") == "param")]
        return tensors + ([node] if meta_of(node) is not None else [])

    def op(self, node: fx.Node) -> Op | None:
        c = cost_mod.node_cost(node)
        t, per_token = self.t, self.scale / self.tokens
        acts = self._activations(node)
        split = any(tpd.is_split(a) for a in acts)
        moved = c.bytes_read + c.bytes_written - c.param_bytes
        moved_split = min(moved, sum(meta_of(a).nbytes for a in acts if tpd.is_split(a))) if moved > 0 else 0
        weights_split = weights_repl = 0.0
        for a in node.all_input_nodes:
            if a.op == "placeholder" and tf(a).get("kind") == "param" and meta_of(a) is not None:
                if tf(a)["fqn"] in self.split_params:
                    weights_split += meta_of(a).nbytes * t * self.scale
                else:
                    weights_repl += meta_of(a).nbytes * self.scale
        if c.flops == 0 and moved <= 0:
            return None
        if cost_mod.op_name(node) in GATHER_OPS and meta_of(node) is not None:
            # a lookup reads the rows it gathers, not the whole table: rows in, rows out, the
            # output whole on every tp rank (vocab-parallel: partial rows, zeros elsewhere)
            weights_split = weights_repl = 0.0
            moved, moved_split = 2 * meta_of(node).nbytes, 0
        if cost_mod.op_name(node) in LOSS_OPS and acts and meta_of(acts[0]).shape:
            # the loss over the logits: the same kernel bytes the shape flags price
            logits = meta_of(acts[0])
            rows = logits.numel // int(logits.shape[-1])
            moved_split = moved = cross_entropy_bytes(int(logits.shape[-1])) * rows / self.scale
            split = split or tpd.is_split(acts[0])
        flops = c.flops / self.tokens
        return Op(cost_mod.op_name(node), flops_split=flops * t if split else 0.0,
                  flops_repl=0.0 if split else flops, bytes_split=moved_split * t * per_token,
                  bytes_repl=max(0, moved - moved_split) * per_token, weight_bytes=weights_split,
                  weight_bytes_repl=weights_repl, matmul=cost_mod.op_name(node) in MATMUL_OPS)

    def ops(self, group) -> tuple[Op, ...]:
        return tuple(op for op in (self.op(n) for n in group) if op is not None)

    def saved(self, group) -> tuple[float, float]:
        """(split, replicated) activation bytes per token the group keeps for backward,
        each value once."""
        by_name = {n.name: n for n in group}
        seen: dict[str, tuple[int, bool]] = {}
        for n in group:
            for value, nbytes in cost_mod.node_cost(n).saved:
                owner = by_name.get(value.split(".")[0]) or _input_named(n, value.split(".")[0])
                seen[value] = (nbytes, owner is not None and tpd.is_split(owner))
        split = sum(b for b, s in seen.values() if s) * self.t
        repl = sum(b for b, s in seen.values() if not s)
        return split * self.scale / self.tokens, repl * self.scale / self.tokens


# The attention kernels a GPU runs (flash / memory-efficient): backward keeps the inputs q, k,
# v (and a mask), the output and one fp32 logsumexp per query row; nothing else of their own.
ATTENTION_OPS = fam.ATTENTION


class _GraphSaved:
    """Per-token (split, replicated) bytes a part of the sharded graph keeps for backward.

    The rules are planner/saved_bytes.py's (exact for autograd on this machine), with one
    change for the GPU cluster the planner prices: an attention op keeps what the GPU's fused
    kernel keeps (ATTENTION_OPS), not the CPU kernel's own extra tensors (given a mask, torch's
    CPU path keeps 2h elements per token of its own: a CPU-only workspace)."""

    def __init__(self, gm: fx.GraphModule, t: int, scale: float, tokens: int):
        self.gm, self.t, self.scale, self.tokens = gm, t, scale, tokens
        self.by_name = {n.name: n for n in gm.graph.nodes}

    def _gpu_kept(self, kept: dict) -> dict:
        """`kept` ({value: (bytes, owner)}) with each attention op's own tensors replaced by
        its logsumexp: fp32, one per (batch, head, query)."""
        out = {}
        for value, (nbytes, owner) in kept.items():
            node = self.by_name.get(owner)
            if "#" in value and node is not None and cost_mod.op_name(node) in ATTENTION_OPS:
                meta = meta_of(node)
                if meta is not None and meta.shape:
                    lse = meta.numel // int(meta.shape[-1]) * 4 / self.scale   # stays fp32 in 16-bit runs
                    out[f"{owner}#logsumexp"] = (lse, owner)
                continue
            out[value] = (nbytes, owner)
        return out

    def per_token(self, names, segments=()) -> tuple[float, float]:
        # lazy: start-up: threefold.planner.saved_bytes loads 1 more modules only when this runs
        from threefold.planner.saved_bytes import nodes_saved
        split = repl = 0
        for nbytes, owner in self._gpu_kept(nodes_saved(self.gm, names, segments)).values():
            node = self.by_name.get(owner)
            if node is not None and tpd.is_split(node):
                split += nbytes
            else:
                repl += nbytes
        return split * self.t * self.scale / self.tokens, repl * self.scale / self.tokens


def _input_named(node, name):
    return next((a for a in node.all_input_nodes if a.name == name), None)


def _flat_nodes(value) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _flat_nodes(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _flat_nodes(v)]
    return []
