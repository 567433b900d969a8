"""The performance model: what one training iteration of a plan costs in time and memory.

It follows the paper (Narayanan et al., SC'21, arXiv 2104.04473) and adds only physics:

* Compute. A transformer layer is a list of ops (`Op`), each with its FLOPs and the
  bytes it moves per token. An op takes max(FLOPs / (peak * matmul_fraction),
  bytes / HBM bandwidth, one kernel launch): a roofline. For a GPT shape the GEMM FLOPs
  sum to exactly the paper's Eq. 3, 96 B s l h^2 (1 + s/6h + V/16lh) with activation
  recomputation (72 B s l h^2 (1 + s/6h + V/12lh) without); the byte counts are those of
  Megatron's kernels (fused softmax, bias-GeLU and bias-dropout-add; unfused attention
  dropout), which is what makes small-hidden models slower per FLOP. Backward costs twice
  the forward (two GEMMs per forward GEMM; gradient kernels read the saved input and the
  incoming gradient); recomputation adds one forward.
* Pipeline. Per microbatch a stage runs its layers forward and backward, its tp
  all-reduces (2 per layer forward, 2 backward, 2 more when recomputing: paper sec. 3.2,
  ring time 2(t-1)/t bytes / link bandwidth), and sends its boundary tensor to the next
  and previous stage once per chunk (with the paper's scatter/gather, 1/t of it crosses
  InfiniBand, then an NVLink all-gather). The iteration takes
  m * t_slowest + (p-1)/v * t_mean: the paper's bubble (p-1)/(v m) (sec. 2.2), which a
  simulation of Megatron's order reproduces exactly (tests). tp spanning nodes (only when
  asked) runs its ring over the nodes' NICs: g * inter-node bandwidth.
  `bubble_fraction` is the share of the iteration a stage spends idle in fill and drain.
* Data parallelism. One gradient all-reduce per iteration, not overlapped (as in the
  paper's runs): ring time 2(d-1)/d bytes / bandwidth, the bandwidth being NVLink when
  the group sits in one node, else k * inter-node bandwidth, k being the members of the
  group per node, each with its own NIC. Then the optimizer step, a memory-bound pass
  over ~32 bytes per local parameter. Tied embeddings add one all-reduce between the
  first and last stage.
* Memory per GPU. 16 bytes per local parameter (fp16 weights and grads, fp32 master
  weights and two Adam moments), plus the activations the schedule keeps: the first
  stage holds min(p, m) microbatches in 1F1B, 2(p-1)+(v-1)p+1 chunks interleaved. Per
  layer and microbatch that is the layer input (2sbh) with recomputation, or
  sbh(10 + 24/t + 5as/(ht)) without (Korthikanti et al. 2022, sec. 4.1), plus one layer's
  full activations while it is recomputed, plus the logits on the last stage.

Nothing here is fitted to the paper's Table 1, row by row or otherwise: constants are
datasheet figures, the paper's bandwidths, and Megatron's byte counts. The one estimate is
the cluster's `matmul_fraction` (see threefold/clusters/a100-80gb.toml), one number per
GPU type; bench/planner_table1.py --sensitivity shows what it does to the Table 1 errors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from threefold.compiler.cluster import Cluster
from threefold.errors import PlanError

BYTES_PER_PARAM = 16          # fp16 weight 2 + fp16 grad 2 + fp32 master 4 + Adam m 4 + v 4
GRAD_BYTES = 2                # gradients are all-reduced in fp16
OPTIMIZER_BYTES_PER_PARAM = 32  # Adam step traffic: read/write master, m, v; read grad; write fp16 weight
ACT_BYTES = 2                 # fp16/bf16 activations


@dataclass(frozen=True)
class Op:
    """One kernel of a layer's forward, costed per token (per microbatch for weights).

    `*_split` quantities are divided by the tp degree (the op is sharded), `*_repl` are
    not (every tp rank does them: layer norms, residual adds without sequence parallelism).
    """
    name: str
    flops_split: float = 0.0      # FLOPs per token, sharded by tp
    bytes_split: float = 0.0      # HBM bytes per token, sharded by tp
    bytes_repl: float = 0.0       # HBM bytes per token, replicated across tp
    weight_bytes: float = 0.0     # bytes of weights read once per microbatch, sharded by tp
    matmul: bool = False          # runs on tensor cores (counts toward Eq. 3's FLOPs)

    def seconds(self, tokens: float, tp: int, cluster: Cluster, dtype: str) -> float:
        flops = self.flops_split * tokens / tp
        moved = (self.bytes_split / tp + self.bytes_repl) * tokens + self.weight_bytes / tp
        peak = cluster.peak(dtype) * (cluster.matmul_fraction if self.matmul else 1.0)
        return max(flops / peak, moved / cluster.hbm_bandwidth, cluster.kernel_launch_s)


@dataclass(frozen=True)
class ModelCost:
    """What the planner needs to know about a model, independent of how it was obtained.

    Built from a GPT shape (`gpt_model_cost`) or from a traced program
    (`spec_cost.model_cost_from_spec`). A model is `layers` identical blocks between a `pre` part
    (embedding, on the first stage) and a `post` part (final norm, logits, loss, on the
    last stage). All per-token figures are for one forward pass.
    """
    name: str
    layers: int
    seq_len: int
    layer_ops: tuple[Op, ...]
    pre_ops: tuple[Op, ...]
    post_ops: tuple[Op, ...]
    layer_params: float               # parameters of one block (all tp ranks together)
    layer_params_repl: float          # of which replicated on every tp rank (norms, some biases)
    pre_params: float                 # embedding parameters, sharded by tp
    pre_params_repl: float            # e.g. position embeddings, replicated
    post_params: float                # output projection when untied (0 when tied to pre)
    tied_embedding: bool              # last stage keeps a copy of the embedding (Megatron)
    tp_allreduce_bytes: float         # per token per layer forward, summed over its all-reduces
    tp_allreduces_per_layer: int      # all-reduces per layer forward (for latency)
    boundary_bytes: float             # activation bytes per token crossing a stage boundary
    act_split: float                  # saved activation bytes per token per layer, sharded
    act_repl: float                   # ... replicated (no sequence parallelism)
    act_input: float                  # bytes per token kept per layer with recomputation
    post_act: float                   # bytes per token the post part keeps (logits, loss)
    post_act_split: bool = True
    tp_divides: tuple[int, ...] = ()  # tp must divide each (attention heads, ...)
    flops_per_iteration_fn: Callable[[int, bool], float] | None = None  # (batch, recompute) -> FLOPs

    @property
    def params(self) -> float:
        return self.layers * self.layer_params + self.pre_params + self.pre_params_repl + self.post_params

    def layer_flops(self) -> float:
        """GEMM FLOPs per token of one layer's forward (all tp ranks together)."""
        return sum(op.flops_split for op in self.layer_ops if op.matmul)

    def flops_per_iteration(self, batch: int, recompute: bool) -> float:
        """Model FLOPs of one iteration as the paper counts them (Eq. 3 with recomputation)."""
        if self.flops_per_iteration_fn is not None:
            return self.flops_per_iteration_fn(batch, recompute)
        tokens = batch * self.seq_len
        layer = self.layer_flops() * (4 if recompute else 3)
        post = sum(op.flops_split for op in self.post_ops + self.pre_ops if op.matmul) * 3
        return tokens * (self.layers * layer + post)


def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """The paper's Eq. 3 (recompute=True) and its variant without recomputation."""
    if recompute:
        return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def gpt_model_cost(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
                   ffn: int | None = None) -> ModelCost:
    """ModelCost of a GPT-2/3 style decoder (Megatron's kernels, fp16, tied embeddings)."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"model {name}={value!r} is invalid: it must be a positive integer")
    if hidden % heads:
        raise PlanError(f"model hidden={hidden} is not divisible by heads={heads}: choose hidden = heads * head_dim")
    h, s, a, V = hidden, seq, heads, vocab
    f = ffn or 4 * h
    A = a * s                 # attention-score elements per token (all heads)
    B = ACT_BYTES
    ops = (
        # name                      flops/token     bytes sharded            bytes replicated    weights
        Op("layernorm1",            bytes_repl=2 * B * h),
        Op("qkv_gemm",              flops_split=2 * h * 3 * h, bytes_split=B * 3 * h, bytes_repl=B * h,
           weight_bytes=B * 3 * h * h, matmul=True),
        Op("scores_bmm",            flops_split=2 * s * h, bytes_split=B * (2 * h + A), matmul=True),
        Op("scale_mask_softmax",    bytes_split=2 * B * A),                 # fused: read + write
        Op("attention_dropout",     bytes_split=2 * B * A + A),             # read, write, 1-byte mask
        Op("context_bmm",           flops_split=2 * s * h, bytes_split=B * (A + 2 * h), matmul=True),
        Op("context_transpose",     bytes_split=2 * B * h),                 # [b,a,s,d] -> [s,b,h]
        Op("dense_gemm",            flops_split=2 * h * h, bytes_split=B * h, bytes_repl=B * h,
           weight_bytes=B * h * h, matmul=True),
        Op("bias_dropout_add1",     bytes_repl=3 * B * h + h),              # fused: out, residual -> sum, mask
        Op("layernorm2",            bytes_repl=2 * B * h),
        Op("fc1_gemm",              flops_split=2 * h * f, bytes_split=B * f, bytes_repl=B * h,
           weight_bytes=B * h * f, matmul=True),
        Op("bias_gelu",             bytes_split=2 * B * f),                 # fused
        Op("fc2_gemm",              flops_split=2 * f * h, bytes_split=B * f, bytes_repl=B * h,
           weight_bytes=B * f * h, matmul=True),
        Op("bias_dropout_add2",     bytes_repl=3 * B * h + h),
    )
    pre = (Op("embedding", bytes_repl=3 * B * h + h),)                      # gather, + position, dropout
    post = (
        Op("final_layernorm", bytes_repl=2 * B * h),
        Op("logits_gemm", flops_split=2 * h * V, bytes_split=B * V, bytes_repl=B * h,
           weight_bytes=B * h * V, matmul=True),
        Op("vocab_parallel_cross_entropy", bytes_split=3 * 4 * V),          # fp32: max, exp-sum, normalise
    )
    layer_params = 3 * h * h + 3 * h + h * h + h + 2 * h * f + f + h + 4 * h  # qkv, dense, fc1, fc2, norms: 12h^2+13h
    return ModelCost(
        name=f"gpt(l={layers},h={hidden},a={heads},V={vocab},s={seq})",
        layers=layers, seq_len=seq, layer_ops=ops, pre_ops=pre, post_ops=post,
        layer_params=layer_params, layer_params_repl=6 * h,  # 2 norms (2h each), 2 row-parallel biases
        pre_params=V * h, pre_params_repl=s * h, post_params=0.0, tied_embedding=True,
        tp_allreduce_bytes=2 * B * h, tp_allreduces_per_layer=2,
        boundary_bytes=B * h,
        # Korthikanti et al. 2022, sec. 4.1: sbh(10 + 24/t + 5as/(ht)) per layer.
        act_split=24 * h + 5 * A, act_repl=10 * h, act_input=B * h,
        post_act=(B + 4) * V, post_act_split=True,                          # fp16 logits + fp32 softmax
        tp_divides=(heads, f),                                              # vocab is padded
        flops_per_iteration_fn=lambda batch, recompute: eq3_flops(batch, s, layers, h, V, recompute),
    )


# ---- estimating one configuration ------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One point of the search space: a Plan plus the microbatch size the planner picks."""
    tp: int
    pp: int
    dp: int
    microbatch_size: int
    interleave: int
    recompute: bool
    batch: int                      # global batch (sequences)

    @property
    def microbatches(self) -> int:
        return self.batch // (self.dp * self.microbatch_size)


@dataclass
class Estimate:
    config: Config
    iteration_s: float
    flops_per_iteration: float      # counted as executed (Eq. 3 when recomputing)
    tflops_per_gpu: float
    peak_fraction: float
    memory_bytes: float             # the fullest GPU (first or last stage)
    fits: bool
    bubble_fraction: float          # share of the iteration a stage idles in fill/drain
    shares: dict = field(default_factory=dict)   # compute/bubble/tp/pp/dp/optimizer -> share of time
    stage_times: list = field(default_factory=list)  # per stage: (forward, backward) s of one chunk
    transfer_s: float = 0.0         # one boundary transfer between stages

    @property
    def samples_per_s(self) -> float:
        return self.config.batch / self.iteration_s


def _ring_allreduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def _ops_s(ops, tokens, tp, cluster, dtype) -> float:
    return sum(op.seconds(tokens, tp, cluster, dtype) for op in ops)


def _layers_on_stages(layers: int, pp: int) -> list[int]:
    base, extra = divmod(layers, pp)
    return [base + (1 if r < extra else 0) for r in range(pp)]


def inflight_chunks(pp: int, m: int, v: int, stage: int = 0) -> int:
    """(chunk, microbatch) activations a stage holds at most: 1F1B pp-r, interleaved
    2(pp-r-1)+(v-1)pp+1 (Megatron's warm-up plus one), both capped by the work there is."""
    if v == 1:
        return min(pp - stage, m)
    return min(v * m, 2 * (pp - stage - 1) + (v - 1) * pp + 1)


def estimate(model: ModelCost, cfg: Config, cluster: Cluster, dtype: str = "bf16") -> Estimate:
    """Predicted time and memory of one iteration (see the module docstring)."""
    t, p, d, b, v = cfg.tp, cfg.pp, cfg.dp, cfg.microbatch_size, cfg.interleave
    m = cfg.microbatches
    g = cluster.gpus_per_node
    tokens = b * model.seq_len
    passes = 4 if cfg.recompute else 3          # forward, backward (2x), recompute forward

    # -- one microbatch through one stage ---------------------------------------------
    layer_fwd = _ops_s(model.layer_ops, tokens, t, cluster, dtype)
    pre_fwd = _ops_s(model.pre_ops, tokens, t, cluster, dtype)
    post_fwd = _ops_s(model.post_ops, tokens, t, cluster, dtype)
    tp_in_node = t <= g
    tp_bw = cluster.intra_node_bandwidth if tp_in_node else g * cluster.inter_node_bandwidth
    tp_lat = cluster.intra_node_latency_s if tp_in_node else cluster.inter_node_latency_s
    one_ar = _ring_allreduce_s(model.tp_allreduce_bytes / model.tp_allreduces_per_layer * tokens, t, tp_bw, tp_lat)
    # Boundary transfer: scatter/gather sends 1/t over the slower link, then all-gathers.
    boundary = model.boundary_bytes * tokens
    stride = t * d                               # ranks between consecutive pipeline stages
    p2p_inter = p > 1 and (stride >= g or p * stride > g)
    link = cluster.inter_node_bandwidth if p2p_inter else cluster.intra_node_bandwidth
    lat = cluster.inter_node_latency_s if p2p_inter else cluster.intra_node_latency_s
    xfer = 0.0
    if p > 1:
        xfer = boundary / t / link + lat
        if t > 1:
            xfer += (t - 1) / t * boundary / cluster.intra_node_bandwidth + (t - 1) * cluster.intra_node_latency_s
    stage_layers = _layers_on_stages(model.layers, p)
    ar_fwd = one_ar * model.tp_allreduces_per_layer            # one layer's forward all-reduces
    compute, tp_time, fwd, bwd = [], [], [], []
    for r, n in enumerate(stage_layers):
        edge = (pre_fwd if r == 0 else 0.0) + (post_fwd if r == p - 1 else 0.0)
        compute.append(n * layer_fwd * passes + edge * 3)
        tp_time.append(n * ar_fwd * (passes - 1))
        fwd.append(n * (layer_fwd + ar_fwd) + edge)
        bwd.append(compute[-1] + tp_time[-1] - fwd[-1])      # backward, with the recomputed forward
    p2p_time = [2 * v * xfer] * p                              # per chunk: activation in, gradient back
    stage = [c + a + x for c, a, x in zip(compute, tp_time, p2p_time)]
    slowest = max(range(p), key=lambda r: stage[r])
    mean = sum(stage) / p
    pipeline_s = m * stage[slowest] + (p - 1) / v * mean
    bubble_s = (p - 1) / v * mean

    # -- per-iteration work: gradients, tied embeddings, optimizer ---------------------
    # Stage 0 holds the most layers (extra layers go first), the embedding and the most
    # in-flight activations; the last stage holds the logits: the fullest GPU is one of them.
    edges = sorted({0, p - 1})
    local_params = {r: _stage_params(model, stage_layers[r], r, p, t) for r in edges}
    most = max(local_params.values())
    dp_s = 0.0
    if d > 1:
        per_node = max(1, min(d, g // t)) if t <= g else 1
        in_node = t * d <= g
        bw = cluster.intra_node_bandwidth if in_node else per_node * cluster.inter_node_bandwidth
        dp_lat = cluster.intra_node_latency_s if in_node else cluster.inter_node_latency_s
        dp_s = _ring_allreduce_s(most * GRAD_BYTES, d, bw, dp_lat)
    embed_s = 0.0
    if p > 1 and model.tied_embedding:
        embed_s = _ring_allreduce_s(model.pre_params / t * GRAD_BYTES, 2, link, lat)
    opt_s = most * OPTIMIZER_BYTES_PER_PARAM / cluster.hbm_bandwidth
    total = pipeline_s + dp_s + embed_s + opt_s

    flops = model.flops_per_iteration(cfg.batch, cfg.recompute)
    world = t * p * d
    tflops = flops / total / world
    shares = {
        "compute": m * compute[slowest] / total,
        "bubble": bubble_s / total,
        "tp": m * tp_time[slowest] / total,
        "pp": m * p2p_time[slowest] / total,
        "dp": (dp_s + embed_s) / total,
        "optimizer": opt_s / total,
    }
    mem = max(_stage_memory(model, cfg, r, stage_layers[r], local_params[r]) for r in edges)
    return Estimate(
        config=cfg, iteration_s=total, flops_per_iteration=flops, tflops_per_gpu=tflops / 1e12,
        peak_fraction=tflops / cluster.peak(dtype), memory_bytes=mem, fits=mem <= cluster.usable_bytes,
        bubble_fraction=bubble_s / total, shares=shares,
        stage_times=[(f / v, b_ / v) for f, b_ in zip(fwd, bwd)], transfer_s=xfer,
    )


def _stage_params(model: ModelCost, n_layers: int, stage: int, pp: int, tp: int) -> float:
    """Parameters one GPU of this stage holds."""
    split = model.layer_params - model.layer_params_repl
    params = n_layers * (split / tp + model.layer_params_repl)
    if stage == 0:
        params += model.pre_params / tp + model.pre_params_repl
    if stage == pp - 1:
        params += model.post_params / tp
        if model.tied_embedding and pp > 1:
            params += model.pre_params / tp     # Megatron keeps a copy of the word embedding
    return params


def _stage_memory(model: ModelCost, cfg: Config, stage: int, n_layers: int, params: float) -> float:
    t, p, v, b = cfg.tp, cfg.pp, cfg.interleave, cfg.microbatch_size
    tokens = b * model.seq_len
    full_layer = (model.act_split / t + model.act_repl) * tokens
    chunks = inflight_chunks(p, cfg.microbatches, v, stage)
    layers_per_chunk = math.ceil(n_layers / v)
    if cfg.recompute:
        # Inputs of every in-flight layer, plus the one layer being recomputed.
        acts = chunks * layers_per_chunk * model.act_input * tokens + full_layer
    else:
        acts = chunks * layers_per_chunk * full_layer
    if stage == p - 1:
        acts += model.post_act * tokens / (t if model.post_act_split else 1)
    return params * BYTES_PER_PARAM + acts
