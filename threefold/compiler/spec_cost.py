"""`model_cost_from_spec`: the planner's `ModelCost` from a traced program.

The SPEC's model is traced once at its example batch (on the meta device if the factory
builds it there) and every node is costed by `compiler/cost.py`. The repeated blocks are
found from module paths: the `prefix.<i>` family with the most members (`h.0`, `h.1`, ...)
is the layer stack. Block 0's nodes become the per-layer ops, nodes before the first
block the `pre` part, nodes after the last block the `post` part.

How a traced op maps to tensor parallelism follows Megatron without sequence
parallelism: GEMM FLOPs are split across tp ranks; a non-GEMM op whose output has the
hidden size as its last dimension (norms, residual adds and their dropouts) runs on every
tp rank; anything wider (attention scores, the MLP's 4h activations) is split. Each
GEMM whose output is hidden-sized is a row-parallel projection: one tp all-reduce.
Bytes are rescaled from the traced dtype to 16-bit training (`ACT_BYTES`).
"""
from __future__ import annotations

import re
from collections import defaultdict

from threefold.compiler.perf_model import ACT_BYTES, ModelCost, Op
from threefold.errors import PlanError

MATMUL_OPS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "scaled_dot_product_attention",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "convolution", "conv1d", "conv2d"}
_HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")


def model_cost_from_spec(spec: str) -> ModelCost:
    """ModelCost of the workload a SPEC names; PlanError when it cannot be derived."""
    try:
        import torch

        from threefold.compiler import cost as cost_mod
        from threefold.compiler.program import compute_nodes, meta_of, tf
        from threefold.compiler.trace import trace
        from threefold.workload import load_spec
    except ImportError as exc:
        raise PlanError(f"SPEC models need the tracer and cost model (threefold.compiler.trace/cost), "
                        f"which are not available ({exc}): describe the model with --layers --hidden "
                        "--heads --vocab --seq instead") from None

    work = load_spec(spec)
    prog = trace(work.model, work.inputs, work.target, work.loss_fn)
    first = work.inputs[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 1:
        raise PlanError(f"SPEC {spec!r}: the first input is not a batched tensor; the planner needs "
                        "(batch, seq, ...) inputs to count tokens")
    seq = int(first.shape[1]) if first.dim() >= 2 else 1
    tokens = int(first.shape[0]) * seq

    nodes = [n for n in compute_nodes(prog.graph) if n.op == "call_function"]
    layer_of = {}
    families: dict[str, set] = defaultdict(set)
    for n in nodes:
        m = re.match(r"^(.*?)\.?(\d+)(?:\.|$)", tf(n).get("module", "") or "")
        if m:
            families[m.group(1)].add(int(m.group(2)))
    if not families or max(len(v) for v in families.values()) < 2:
        raise PlanError(f"SPEC {spec!r}: no repeated blocks found (module paths like 'h.0', 'h.1'); the "
                        "planner models a stack of identical layers: describe it with --layers --hidden ...")
    prefix = max(families, key=lambda k: len(families[k]))
    pattern = re.compile(rf"^{re.escape(prefix)}\.?(\d+)(?:\.|$)")
    for n in nodes:
        m = pattern.match(tf(n).get("module", "") or "")
        if m:
            layer_of[n.name] = int(m.group(1))
    indices = sorted(set(layer_of.values()))
    first_pos = min(i for i, n in enumerate(nodes) if n.name in layer_of)
    last_pos = max(i for i, n in enumerate(nodes) if n.name in layer_of)
    block0 = [n for n in nodes if layer_of.get(n.name) == indices[0]]
    block1 = {n.name for n in nodes if layer_of.get(n.name) == indices[1]}
    pre = [n for n in nodes[:first_pos] if n.name not in layer_of]
    post = [n for n in nodes[last_pos + 1:] if n.name not in layer_of]

    # The boundary: what block 1 reads from outside itself (the residual stream).
    boundary = {a.name: meta_of(a) for n in nodes if n.name in block1 for a in n.all_input_nodes
                if a.name not in block1 and a.op == "call_function" and meta_of(a) is not None}
    if not boundary:
        raise PlanError(f"SPEC {spec!r}: cannot find the tensor passed between blocks {prefix}.0 and {prefix}.1")
    bmeta = max(boundary.values(), key=lambda m: m.numel)
    hidden = int(bmeta.shape[-1])
    param_elt = max((t.element_size() for t in prog.state.values() if t.is_floating_point()), default=4)
    scale = ACT_BYTES / param_elt

    def to_op(n) -> Op | None:
        c = cost_mod.node_cost(n)
        name = cost_mod.op_name(n)
        out = meta_of(n)
        moved = (c.bytes_read + c.bytes_written - c.param_bytes) * scale / tokens
        if c.flops == 0 and moved == 0:
            return None
        wide = out is None or not out.shape or int(out.shape[-1]) != hidden
        if name in MATMUL_OPS:
            return Op(name, flops_split=c.flops / tokens, bytes_split=moved,
                      weight_bytes=c.param_bytes * scale, matmul=True)
        if wide:
            return Op(name, bytes_split=moved)
        return Op(name, bytes_repl=moved)

    def ops(group) -> tuple[Op, ...]:
        return tuple(op for op in (to_op(n) for n in group) if op is not None)

    def saved(group, replicated: bool) -> float:
        total = 0.0
        for n in group:
            out = meta_of(n)
            repl = out is not None and out.shape and int(out.shape[-1]) == hidden and \
                cost_mod.op_name(n) not in MATMUL_OPS
            if bool(repl) == replicated:
                total += cost_mod.node_cost(n).saved_bytes
        return total * scale / tokens

    def params_of(group) -> dict[str, object]:
        names = {}
        for n in group:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and tf(a).get("kind") == "param":
                    names[tf(a)["fqn"]] = prog.state[tf(a)["fqn"]]
        return names

    layer_params = params_of(block0)
    layer_repl = sum(t.numel() for t in layer_params.values() if t.dim() == 1 and t.numel() == hidden)
    pre_params, post_params = params_of(pre), params_of(post)
    tied = {f for group in prog.ties.values() for f in group} | set(prog.ties)
    tied_embedding = any(f in tied for f in pre_params) and any(f in tied for f in post_params)
    biggest_pre = max(pre_params, key=lambda f: pre_params[f].numel(), default=None)
    row_parallel = [n for n in block0 if cost_mod.op_name(n) in ("linear", "mm", "addmm", "matmul")
                    and meta_of(n) is not None and int(meta_of(n).shape[-1]) == hidden
                    and params_of([n])]
    divides = {int(d) for t in layer_params.values() if t.dim() == 2 for d in t.shape if int(d) != hidden}
    for module in work.model.modules():
        for attr in _HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and value > 0:
                divides.add(value)
    return ModelCost(
        name=spec, layers=len(indices), seq_len=seq,
        layer_ops=ops(block0), pre_ops=ops(pre), post_ops=ops(post),
        layer_params=float(sum(t.numel() for t in layer_params.values())), layer_params_repl=float(layer_repl),
        pre_params=float(pre_params[biggest_pre].numel()) if biggest_pre else 0.0,
        pre_params_repl=float(sum(t.numel() for f, t in pre_params.items() if f != biggest_pre)),
        post_params=float(sum(t.numel() for f, t in post_params.items() if f not in tied)),
        tied_embedding=tied_embedding,
        tp_allreduce_bytes=len(row_parallel) * hidden * ACT_BYTES,
        tp_allreduces_per_layer=max(1, len(row_parallel)),
        boundary_bytes=bmeta.nbytes * scale / tokens,
        act_split=saved(block0, replicated=False), act_repl=saved(block0, replicated=True),
        act_input=bmeta.nbytes * scale / tokens,
        post_act=saved(post, replicated=False) + saved(post, replicated=True),
        tp_divides=tuple(sorted(divides)),
    )
