"""The performance model: what one training iteration of a plan costs in time.

It follows the paper (Narayanan et al., SC'21, arXiv 2104.04473) and adds only physics:

* Compute. A transformer layer is a list of ops (`model_cost.Op`), each with its FLOPs
  and the bytes it moves per token. An op takes max(FLOPs / (peak * matmul_fraction),
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
  m * t_slowest + (p-1)/v * t_mean: the paper's bubble (p-1)/(v m) (sec. 2.2), which the
  runtime's schedule (runtime/schedule.py), simulated, reproduces exactly for any m >= p
  (tests). tp spanning nodes (only when asked) runs its ring over the nodes' NICs:
  g * inter-node bandwidth.
  `bubble_fraction` is the share of the iteration a stage spends idle in fill and drain.
* Data parallelism. One gradient all-reduce per iteration, not overlapped (as in the
  paper's runs): ring time 2(d-1)/d bytes / bandwidth, the bandwidth being NVLink when
  the group sits in one node, else k * inter-node bandwidth, k being the members of the
  group per node, each with its own NIC. Then the optimizer step, a memory-bound pass
  over ~32 bytes per local parameter. Tied embeddings add one all-reduce between the
  first and last stage.
* Memory per GPU: `memory.py` (parameters, optimizer state, and the activations the
  runtime's schedule keeps in flight).

Nothing here is fitted row by row: constants are datasheet figures, the paper's bandwidths,
and Megatron's byte counts. The one fitted number is the cluster's `matmul_fraction`, one
per GPU type: for A100s a least-squares fit to the paper's Table 1 and its 175B figure
(planner/calibrate.py, `bench/planner_table1.py --fit`); --sensitivity shows what it does
to the errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from threefold.plan import Plan
from threefold.planner.cluster import Cluster
from threefold.planner.memory import stage_memory, stage_params
from threefold.planner.model_cost import GRAD_BYTES, OPTIMIZER_BYTES_PER_PARAM, ModelCost
from threefold.planner.zero_bubble_time import bubble_seconds
from threefold.runtime.mesh import Mesh, chunk_layout, stage_of
from threefold.runtime.schedule import SPLIT_KINDS
from threefold.planner.moe import moe_seconds


@dataclass(frozen=True)
class Config:
    """One point of the search space: a runtime Plan and the global batch it splits.

    The microbatch size is derived, as the runtime derives it: batch / (dp * m)."""
    plan: Plan
    batch: int                      # global batch (sequences)

    @property
    def microbatch_size(self) -> int:
        return self.batch // (self.plan.dp * self.plan.microbatches)

    # The plan's sizes under the names the model's formulas use.
    tp = property(lambda self: self.plan.tp)
    pp = property(lambda self: self.plan.pp)
    dp = property(lambda self: self.plan.dp)
    interleave = property(lambda self: self.plan.interleave)
    recompute = property(lambda self: self.plan.recompute == "full")   # modelled: full or none
    microbatches = property(lambda self: self.plan.microbatches)
    ep = property(lambda self: self.plan.ep)


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
    # per stage: of one chunk's backward, the weight-gradient GEMMs' seconds (W of zero-bubble
    # schedules; the rest is B, the input gradients)
    weight_times: list = field(default_factory=list)
    transfer_s: float = 0.0         # one boundary transfer between stages
    # the model's sum came out above the cluster's measured_best_fraction of peak: held there
    capped: bool = False
    model_s: float = 0.0            # the model's own sum before the ceiling (ranks the plans)

    @property
    def samples_per_s(self) -> float:
        return self.config.batch / self.iteration_s


# The best whole-step efficiency measured for dense transformer training with these methods
# on an A100: Narayanan et al. (SC'21), Table 1, 163 of 312 TFLOP/s (the 530B and 1T rows).
# Their GPT-3 175B run reached 140 (45%). Each cluster carries its own device's figure
# (Cluster.measured_best_fraction: this one for A100s, Megatron-LM's 47% for H100s); no plan
# is predicted above it (bench/planner_table1.py).
MEASURED_BEST_PEAK_FRACTION = 163 / 312


def _ring_allreduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def _dp_seconds(plan, grad_bytes: float, d: int, bw: float, lat: float, compute_per_mb: float,
                units: int = 1) -> float:
    """Data-parallel communication a step exposes. zero=0/1: one all-reduce of the gradients
    (or its reduce-scatter + all-gather, the same volume) after the last backward. zero=2:
    a reduce-scatter per microbatch as backward produces it (overlapped with that backward)
    and one all-gather of the updated rows. zero=3: per microbatch two all-gathers of the
    parameters (forward, backward) and a reduce-scatter, prefetched a layer ahead, so only
    what exceeds the microbatch's compute (and the first layer's gather) shows."""
    half = _ring_allreduce_s(grad_bytes, d, bw, lat) / 2   # one reduce-scatter or all-gather
    zero, m = plan.zero, plan.microbatches
    if zero <= 1:
        return 2 * half
    if zero == 2:
        return m * max(0.0, half - compute_per_mb) + half
    # zero=3 gathers and reduce-scatters one unit (layer) at a time: each of the 3 * units
    # collectives pays its ring's latency, (d-1) hops; across nodes that is the inter-node
    # link's latency per hop (128 nodes: 2.5 ms per collective, not once per microbatch)
    per_mb = 3 * (half + max(0, units - 1) * (d - 1) * lat)
    return m * max(per_mb - compute_per_mb, per_mb / 3 / max(1, plan.microbatches))


def _ops_s(ops, tokens, tp, cluster, dtype) -> float:
    return sum(op.seconds(tokens, tp, cluster, dtype) for op in ops)


def _weight_grad_s(ops, tokens, tp, cluster, dtype) -> float:
    """The weight-gradient GEMMs of these ops' backward (zero bubble's W): one per GEMM that
    reads a weight, as long as its forward (grad_W = grad_out^T @ input has its FLOPs)."""
    return sum(op.seconds(tokens, tp, cluster, dtype) for op in ops
               if op.matmul and (op.weight_bytes or op.weight_bytes_repl))


def _layers_on_stages(layers: int, pp: int) -> list[int]:
    base, extra = divmod(layers, pp)
    return [base + (1 if r < extra else 0) for r in range(pp)]


def estimate(model: ModelCost, cfg: Config, cluster: Cluster, dtype: str = "bf16") -> Estimate:
    """Predicted time and memory of one iteration (see the module docstring)."""
    t, p, d, b, v = cfg.tp, cfg.pp, cfg.dp, cfg.microbatch_size, cfg.interleave
    m = cfg.microbatches
    g = cluster.gpus_per_node
    cp = cfg.plan.cp
    # cp: each rank holds s/cp of every sequence; its queries still meet all s keys (the
    # ring), so per-token costs are unchanged and the tokens are divided
    tokens = b * model.seq_len / cp
    passes = 4 if cfg.recompute else 3          # forward, backward (2x), recompute forward

    # -- one microbatch through one stage ---------------------------------------------
    layer_fwd = _ops_s(model.layer_ops, tokens, t, cluster, dtype)
    # recompute=selective reruns the ops it recomputes (the attention core) once more in backward
    rerun_fwd = (_ops_s([op for op in model.layer_ops if op.selective], tokens, t, cluster, dtype)
                 if cfg.plan.recompute == "selective" else 0.0)
    a2a_fwd = 0.0
    if model.moe is not None:   # expert GEMMs and all-to-alls (planner/moe.py), fwd + bwd -> per forward
        moe_s, a2a_s = moe_seconds(model.moe, tokens, t, cfg.ep, cluster, dtype)
        layer_fwd, a2a_fwd = layer_fwd + moe_s / 3, a2a_s / 2
    pre_fwd = _ops_s(model.pre_ops, tokens, t, cluster, dtype)
    post_fwd = _ops_s(model.post_ops, tokens, t, cluster, dtype)
    tp_in_node = t <= g
    tp_bw = cluster.intra_node_bandwidth if tp_in_node else g * cluster.inter_node_bandwidth
    tp_lat = cluster.intra_node_latency_s if tp_in_node else cluster.inter_node_latency_s
    one_ar = _ring_allreduce_s(model.tp_allreduce_bytes / model.tp_allreduces_per_layer * tokens, t, tp_bw, tp_lat)
    # Boundary transfer: scatter/gather sends 1/t over the slower link, then all-gathers.
    boundary = model.boundary_bytes * tokens
    mesh = Mesh(tp=t, dp=d, pp=p, cp=cp)         # the runtime's rank layout (Megatron's, cp inside dp)
    stride = mesh.rank(pp=1) - mesh.rank(pp=0)   # ranks between consecutive pipeline stages
    p2p_inter = p > 1 and (stride >= g or p * stride > g)
    link = cluster.inter_node_bandwidth if p2p_inter else cluster.intra_node_bandwidth
    lat = cluster.inter_node_latency_s if p2p_inter else cluster.intra_node_latency_s
    xfer = 0.0
    if p > 1:
        xfer = boundary / t / link + lat
        if t > 1:
            xfer += (t - 1) / t * boundary / cluster.intra_node_bandwidth + (t - 1) * cluster.intra_node_latency_s
    stage_layers = _layers_on_stages(model.layers, p)
    ar_fwd = one_ar * model.tp_allreduces_per_layer + a2a_fwd  # one layer's forward all-reduces (and ep's all-to-alls)
    # the stage holding the last chunk (the post part): p-1, or 0 on ZB-V's V (runtime/mesh.py)
    post_stage = stage_of(p * v - 1, p, chunk_layout(cfg.plan.schedule))
    layer_w = _weight_grad_s(model.layer_ops, tokens, t, cluster, dtype)
    pre_w = _weight_grad_s(model.pre_ops, tokens, t, cluster, dtype)
    post_w = _weight_grad_s(model.post_ops, tokens, t, cluster, dtype)
    # cp ring per layer: K and V (about two hidden vectors per token) pass cp-1 hops forward,
    # K, V and their gradients 2cp-1 hops backward, overlapped with the layer's compute
    ring = 0.0
    if cp > 1:
        cp_in_node = t * cp <= g
        cp_bw = cluster.intra_node_bandwidth if cp_in_node else cluster.inter_node_bandwidth
        cp_lat = cluster.intra_node_latency_s if cp_in_node else cluster.inter_node_latency_s
        hop = 2 * model.boundary_bytes * tokens / cp_bw + cp_lat
        ring = max(0.0, (cp - 1) * hop - layer_fwd) + max(0.0, (2 * cp - 1) * hop - 2 * layer_fwd)
    compute, tp_time, fwd, bwd, wgt = [], [], [], [], []
    for r, n in enumerate(stage_layers):
        edge = (pre_fwd if r == 0 else 0.0) + (post_fwd if r == post_stage else 0.0)
        wgt.append(n * layer_w + (pre_w if r == 0 else 0.0) + (post_w if r == post_stage else 0.0))
        compute.append(n * (layer_fwd * passes + rerun_fwd) + edge * 3)
        tp_time.append(n * (ar_fwd * (passes - 1) + ring))
        fwd.append(n * (layer_fwd + ar_fwd) + edge)
        bwd.append(compute[-1] + tp_time[-1] - fwd[-1])      # backward, with the recomputed forward
    p2p_time = [2 * v * xfer] * p                              # per chunk: activation in, gradient back
    stage = [c + a + x for c, a, x in zip(compute, tp_time, p2p_time)]
    slowest = max(range(p), key=lambda r: stage[r])
    mean = sum(stage) / p
    pipeline_s = m * stage[slowest] + (p - 1) / v * mean
    bubble_s = (p - 1) / v * mean
    if cfg.plan.schedule in SPLIT_KINDS:   # zero bubble: the paper's forms (zero_bubble_time.py)
        f_mean = sum(fwd) / p + v * xfer
        b_mean = sum(b_ - w for b_, w in zip(bwd, wgt)) / p + v * xfer
        bubble_s = bubble_seconds(cfg.plan.schedule, p, f_mean, b_mean, sum(wgt) / p)
        pipeline_s = m * stage[slowest] + bubble_s

    # -- per-iteration work: gradients, tied embeddings, optimizer ---------------------
    # Stage 0 holds the most layers (extra layers go first), the embedding and the most
    # in-flight activations; the last stage holds the logits: the fullest GPU is one of them.
    edges = sorted({0, p - 1})
    local_params = {r: stage_params(model, stage_layers[r], r, p, t, cfg.ep) for r in edges}
    most = max(local_params.values())
    dp_s = 0.0
    if d * cp > 1:   # replicated gradients are reduced over dp x cp (runtime/mesh.BATCH_AXES)
        d = d * cp
        # ranks between members of the dp (x cp) group: cp ranks are tp apart
        dp_stride = t if cp > 1 else mesh.rank(dp=1) - mesh.rank(dp=0)
        per_node = max(1, min(d, g // dp_stride)) if dp_stride <= g else 1
        in_node = dp_stride * d <= g
        bw = cluster.intra_node_bandwidth if in_node else per_node * cluster.inter_node_bandwidth
        dp_lat = cluster.intra_node_latency_s if in_node else cluster.inter_node_latency_s
        dp_s = _dp_seconds(cfg.plan, most * GRAD_BYTES, d, bw, dp_lat, m * stage[slowest] / max(1, m),
                           units=max(stage_layers) if stage_layers else 1)
    embed_s = 0.0
    if p > 1 and model.tied_embedding and post_stage != 0:   # ZB-V: both ends on stage 0
        embed_s = _ring_allreduce_s(model.pre_params / t * GRAD_BYTES, 2, link, lat)
    opt_s = most * OPTIMIZER_BYTES_PER_PARAM / cluster.hbm_bandwidth
    total = pipeline_s + dp_s + embed_s + opt_s

    flops = model.flops_per_iteration(cfg.batch, cfg.recompute)
    world = t * p * cfg.dp * cp
    # Never above the best efficiency anyone measured for this kind of training: the model
    # prices each piece from its own bound, and such sums drift high on the biggest plans
    # (Narayanan et al.'s best row ran at 52% of an A100's peak; Megatron-LM reports 47% on
    # H100s): the cluster's device's figure. A capped plan says so (`capped`).
    floor_s = flops / (world * cluster.measured_best_fraction * cluster.peak(dtype))
    capped = total < floor_s
    model_s = total
    extra_s = max(0.0, floor_s - total)
    total = max(total, floor_s)
    tflops = flops / total / world
    shares = {
        "compute": (m * compute[slowest] + extra_s) / total,
        "bubble": bubble_s / total,
        "tp": m * tp_time[slowest] / total,
        "pp": m * p2p_time[slowest] / total,
        "dp": (dp_s + embed_s) / total,
        "optimizer": opt_s / total,
    }
    mem = max(stage_memory(model, cfg, r, stage_layers[r], local_params[r]) for r in edges)
    return Estimate(
        config=cfg, iteration_s=total, flops_per_iteration=flops, tflops_per_gpu=tflops / 1e12,
        peak_fraction=tflops / cluster.peak(dtype), memory_bytes=mem, fits=mem <= cluster.usable_bytes,
        bubble_fraction=bubble_s / total, shares=shares,
        stage_times=[(f / v, b_ / v) for f, b_ in zip(fwd, bwd)], transfer_s=xfer,
        weight_times=[w / v for w in wgt], capped=capped, model_s=model_s,
    )
