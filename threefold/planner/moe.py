"""The performance model of one MoE layer under tp=n against ep=n (the same n ranks, the same
G tokens of the global microbatch), forward and backward.

Both give each rank 1/n of the experts' FLOPs, 18 G k h f / n for SwiGLU experts
(gate+up [h, 2f] and down [f, h]: 6 G k h f forward, twice that backward). They differ in
  * kernels: tp runs all E experts at 1/n width on every rank (2 GEMMs forward, 4 backward
    per expert), ep runs E/n experts at full width on the rows routed to them; each GEMM is
    max(FLOPs / (peak x matmul_fraction), one kernel launch): many thin experts are
    launch-bound;
  * communication: tp all-reduces the G tokens' hidden states once forward and once
    backward (ring: 2(n-1)/n G h b bytes each); ep moves each rank's G/n x k rows there and
    back, forward and backward: four all-to-alls of (n-1)/n x G k h b / n bytes per rank.
    So ep moves k/n of tp's bytes: less whenever top-k < n.
With k > n, ep's extra bytes are paid back by tp's extra launches once there are enough
experts: `crossover_experts` finds that E. Expert load is taken as balanced (each expert
gets G k / E rows); an imbalanced router slows ep's busiest rank, which this leaves out.
"""
from __future__ import annotations

from dataclasses import dataclass

from threefold.planner.model_cost import MoeLayer, Op  # noqa: F401 (MoeLayer: read from here too)
import dataclasses
from threefold.errors import PlanError


@dataclass(frozen=True)
class MoeShape:
    tokens: int          # G: tokens of the global microbatch (over the n ranks)
    hidden: int          # h
    ffn: int             # f: one expert's intermediate size
    experts: int         # E
    top_k: int           # k
    dtype_bytes: int = 2


def _gemms_s(count: int, flops_each: float, peak: float, launch: float) -> float:
    return count * max(flops_each / peak, launch)


def layer_seconds(shape: MoeShape, n: int, mode: str, cluster, dtype: str = "bf16") -> float:
    """Forward + backward seconds of one MoE layer on one of n ranks (intra-node)."""
    g, h, f, e, k, b = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k, shape.dtype_bytes
    peak = cluster.peak(dtype) * cluster.matmul_fraction
    launch, bw, lat = cluster.kernel_launch_s, cluster.intra_node_bandwidth, cluster.intra_node_latency_s
    rows = g * k / e                                   # rows per expert (balanced)
    if mode == "tp":
        per_expert = 6 * rows * h * f / n              # forward FLOPs of one expert's 1/n slice
        compute = _gemms_s(e * 6, per_expert / 2, peak, launch)   # 2 fwd + 4 bwd GEMMs per expert
        comm = 2 * (2 * (n - 1) / n * g * h * b / bw + 2 * (n - 1) * lat)
    elif mode == "ep":
        per_expert = 6 * rows * h * f
        compute = _gemms_s(e // n * 6, per_expert / 2, peak, launch)
        comm = 4 * ((n - 1) / n * g * k * h * b / n / bw + (n - 1) * lat)
    else:
        raise ValueError(f"mode {mode!r}: use 'tp' or 'ep'")
    return compute + comm


def crossover_experts(shape: MoeShape, n: int, cluster, dtype: str = "bf16", limit: int = 4096) -> int | None:
    """The smallest E (a multiple of n) from which ep=n is faster than tp=n for this layer,
    or None when it never is up to `limit` experts."""
    e = n
    while e <= limit:
        s = MoeShape(shape.tokens, shape.hidden, shape.ffn, e, shape.top_k, shape.dtype_bytes)
        if layer_seconds(s, n, "ep", cluster, dtype) < layer_seconds(s, n, "tp", cluster, dtype):
            return e
        e += n
    return None


# -- the plan search's view: a GPT-shaped model whose MLPs are MoE layers -----------------
def moe_seconds(moe: MoeLayer, tokens: float, tp: int, ep: int, cluster,
                dtype: str = "bf16", dtype_bytes: int = 2) -> tuple[float, float]:
    """(expert GEMMs, all-to-alls) seconds, forward + backward, of one MoE layer on one rank
    holding `tokens` tokens, under tp (each expert 1/tp wide) and ep (E/ep experts, the ep
    group's tokens routed to them): the terms of `layer_seconds` for tp=n (ep=1) and ep=n
    (tp=1). tp's all-reduce of the layer output is the dense model's (ModelCost)."""
    peak, hidden = cluster.peak(dtype) * cluster.matmul_fraction, moe.hidden
    rows = ep * tokens * moe.top_k / moe.experts              # rows per expert (balanced)
    per_expert = 6 * rows * hidden * moe.ffn / tp
    compute = _gemms_s(moe.experts // ep * 6, per_expert / 2, peak, cluster.kernel_launch_s)
    a2a = 0.0
    if ep > 1:
        bw, lat = cluster.intra_node_bandwidth, cluster.intra_node_latency_s
        a2a = 4 * ((ep - 1) / ep * tokens * moe.top_k * hidden * dtype_bytes / bw + (ep - 1) * lat)
    return compute, a2a


# A dropless top-k router's bookkeeping, one small kernel each (as Hugging Face's Mixtral runs
# it): softmax over E, top-k, renormalise, sort the rows by expert, expert and token of each
# row, per-expert counts and offsets, the inverse permutation (allocate, fill).
ROUTING_KERNELS = ("softmax", "topk", "renormalise", "sort", "expert_of_row", "token_of_row", "counts",
                   "offsets", "inverse_alloc", "inverse_fill", "row_ids")


def routing_ops(hidden: int, experts: int, top_k: int, dtype_bytes: int = 2) -> tuple:
    """The kernels of one MoE layer around its expert GEMMs, per token (every tp rank runs
    them whole): the router's bookkeeping (launch-bound), then the rows' data movement:
    gather each token's row k times in expert order, scale by the router weight, scatter back
    to token order, and sum the k rows. A SPEC's graph holds the same kernels
    (spec_cost.py prices them node by node), so both descriptions agree."""
    h, k, b = hidden, top_k, dtype_bytes
    small = tuple(Op(f"router_{name}", bytes_repl=2 * b * experts) for name in ROUTING_KERNELS)
    return small + (
        Op("moe_permute", bytes_repl=b * (h + k * h)),
        Op("moe_scale", bytes_repl=2 * b * k * h),
        Op("moe_unpermute", bytes_repl=2 * b * k * h),
        Op("moe_combine", bytes_repl=b * (k * h + h)),
    )


def moe_model_cost(layers: int, hidden: int, heads: int, experts: int, top_k: int, ffn: int,
                   vocab: int = 51200, seq: int = 2048, kv_heads: int | None = None, tied: bool = True,
                   attention: str | None = None, mlp: str = "gelu"):
    """The dense shape's ModelCost (gpt_cost.gpt_model_cost: GPT's by default, `mlp="swiglu"`
    for the Llama-like rest of a Mixtral: rotary, no dropout, flash attention) with each MLP
    replaced by this MoE: the expert GEMMs are priced by `moe_seconds` in the estimate,
    their parameters by E/ep, the kernels around them by `routing_ops`. Under tp the expert
    rows are all-reduced before the k of each token are summed (the tensor-parallel pass's
    choice: k rows of h per token, where attention's all-reduce moves one)."""
    # lazy: start-up: threefold.planner.gpt_cost loads 1 more modules only when this runs
    from threefold.planner.gpt_cost import gpt_model_cost
    for name, value in (("experts", experts), ("top_k", top_k), ("ffn", ffn)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"model {name}={value!r} is invalid: it must be a positive integer")
    if top_k > experts:
        raise PlanError(f"model top_k={top_k} exceeds experts={experts}: route to at most E experts")
    # the attention and embeddings as the dense shape flags describe them (GQA, untied)
    dense = gpt_model_cost(layers, hidden, heads, vocab, seq, kv_heads=kv_heads, tied=tied, attention=attention,
                           mlp=mlp)
    h, f = hidden, 4 * hidden
    up = 2 * f if mlp == "swiglu" else f
    moe = MoeLayer(experts, top_k, ffn, hidden)
    dense_mlp = ("fc1_gemm", "bias_gelu", "swiglu", "fc2_gemm")
    ops = tuple(op for op in dense.layer_ops if op.name not in dense_mlp)
    # the router: every rank scores its tokens against the E experts (replicated), then a
    # softmax and top-k over E per token (one fused kernel)
    router = h * experts
    ops += (Op("router_gemm", flops_repl=2 * h * experts, bytes_repl=2 * h + 2 * experts,
               weight_bytes_repl=2 * router, matmul=True),) + routing_ops(h, experts, top_k)
    flops = 2 * 3 * h * ffn * top_k                            # expert GEMM FLOPs per token, forward
    mlp_flops = sum(op.flops for op in dense.layer_ops if op.name in dense_mlp and op.matmul)
    activations = {}
    if mlp == "swiglu" and (attention or "flash") == "flash":
        # what the layer keeps for backward (router, the k rows of each token through their
        # expert, ...): counted on the traced graph of this MoE decoder by the SPEC path's
        # rules (planner/reference_layer.py), as for the dense Llama-like shape
        # lazy: start-up: the reference decoder is traced only for swiglu/MoE flags
        from threefold.planner.reference_layer import ACTIVATION_FIELDS, flags_activations
        kv = kv_heads or heads
        found = flags_activations(hidden, heads, kv, ffn, vocab, seq, tied, experts, top_k)
        activations = {k: found[k] for k in ACTIVATION_FIELDS}
    return dataclasses.replace(
        dense, **activations, tp_allreduce_bytes=dense.tp_allreduce_bytes / 2 * (1 + top_k),
        name=f"moe(l={layers},h={h},a={heads},E={experts},k={top_k},f={ffn})", layer_ops=ops,
        # the dense MLP's weights (and GPT's biases: a swiglu layer has none) out, the router in
        layer_params=dense.layer_params - (h * up + f * h + (0 if mlp == "swiglu" else up + h)) + router,
        layer_params_repl=dense.layer_params_repl + router,
        tp_divides=tuple(sorted({heads, kv_heads or heads, ffn})), moe=moe,
        flops_per_iteration_fn=lambda batch, recompute: dense.flops_per_iteration(batch, recompute)
        - batch * seq * layers * (mlp_flops - flops - 2 * h * experts) * (4 if recompute else 3))
