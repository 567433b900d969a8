"""The memory model: bytes per rank, by component, for a plan (inspect --memory, the planner, fits).

One set of rules, fed either by a compiled program (`program_memory`: exact local shapes,
saved activations derived from the chunk graphs by planner/saved_bytes.py) or by the
planner's per-layer `ModelCost` (`stage_memory`: a model too large to compile per candidate).

  params      this rank's parameter shards (unique: a tied parameter two local chunks use
              is one Parameter; ep: E/ep of each expert weight) and module buffers, in their dtype. dtype=bf16|fp16 keeps
              parameters fp32 (runtime/mixed_precision.py: they are the master weights).
              zero=3: only this dp_shard rank's rows of each trainable parameter.
  gathered    zero=3: parameters whole for a while (runtime/fsdp.py): every local chunk's
              unit 0 and, with the next one prefetched, the two largest layer units.
  grads       one gradient per trainable parameter, fp32 under every dtype; zero>=2: this
              dp_shard rank's rows of it (the whole gradients of one unit at a time are in
              `buffers`).
  optimizer   AdamW's two moments (and its step counter) per trainable element; zero>=1
              keeps only this dp_shard rank's rows (runtime/zero.py: ceil(R/d) rows of dim 0).
  activations what autograd keeps for backward over the schedule: each (chunk, microbatch)
              between its forward and its backward holds its chunk's saved bytes; the peak
              over this stage's action list from the runtime's own schedule generator
              (runtime/schedule.make_schedule), so gpipe, 1f1b and interleaved (and any
              schedule added there) are counted from the order the engine runs, not a formula.
  recompute   while backward reruns a recomputed segment its saved values exist again: the
              largest segment's (0 without recomputation).
  buffers     communication: the received boundary tensors no op keeps (the engine holds
              them until backward) for each in-flight microbatch, one gradient message, and,
              with dp > 1, the flat gradient buckets of the dp all-reduce / reduce-scatter
              (zero>=2: one unit's whole gradients and their reduce-scatter buffer).

`total` adds each component's own peak. `peak` is the step's peak, when they do not all
coexist (what a dry run measures, runtime/dry_run.py): walking the stage's actions, a
forward holds the in-flight activations, its chunk's saved values and the values it makes
that nothing keeps (the generated forward's locals hold them until it returns: on the
last stage the loss is computed in there), plus the gradients once a backward has run; a
backward holds the in-flight activations and the gradients (and a recomputed segment's
values); the dp gradient buckets exist after the last backward, with the gradients only.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from threefold.planner.model_cost import BYTES_PER_PARAM, ModelCost
from threefold.runtime.schedule import make_schedule
from threefold.runtime.zero import row_range
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.runtime.schedule import inflight_bound
from threefold.ir.program import tf
from threefold.placement import on_mesh_of
from threefold.runtime.mesh import chunk_layout, stage_of
from threefold.runtime.mixed_precision import COMPUTE_DTYPES

if TYPE_CHECKING:
    from threefold.planner.estimate import Config

ADAM_MOMENTS = 2             # AdamW: exp_avg, exp_avg_sq (fp32)
STATE_BYTES = 4              # fp32 master parameters, gradients and moments (every dtype)
STEP_BYTES = 4               # AdamW's per-parameter step counter (a 0-d fp32 tensor)
COMPONENTS = ("params", "gathered", "grads", "optimizer", "activations", "recompute", "buffers")


@dataclass
class RankMemory:
    rank: int
    stage: int
    params: int = 0
    gathered: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    recompute: int = 0
    buffers: int = 0
    peak: int = 0            # the step's peak (module doc), not a component

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in COMPONENTS)

    def to_json(self) -> dict:
        return {**asdict(self), "total": self.total}


# ---- shared rules ---------------------------------------------------------------------------
def zero_rows(rows: int, dp: int, dp_rank: int) -> int:
    """Rows of a dim-0 size `rows` that dp_shard rank `dp_rank` owns under ZeRO (runtime/zero.py)."""
    return row_range(rows, dp, dp_rank)[2]


def owned_elements(shape: tuple[int, ...], d: int, r: int) -> int:
    """Elements of a parameter of `shape` that dp_shard rank r owns."""
    rows = int(shape[0]) if len(shape) else 1
    width = math.prod(shape[1:]) if len(shape) > 1 else 1
    return zero_rows(rows, d, r) * width


def optimizer_bytes(shapes: list[tuple[int, ...]], plan, dp_rank: int = 0,
                    moments: int = ADAM_MOMENTS) -> int:
    """AdamW state of these trainable parameter shapes on one dp_shard rank."""
    d = _zero_ranks(plan) if getattr(plan, "zero", 0) else 1
    dp_rank = dp_rank if d > 1 else 0
    total = 0
    for shape in shapes:
        owned = owned_elements(shape, d, dp_rank)
        total += moments * STATE_BYTES * owned + (STEP_BYTES if owned or d == 1 else 0)
    return total


def peak_inflight(plan, stage: int, chunk_bytes: dict[int, float], sched=None) -> float:
    """The most activation bytes a stage holds at once under the plan's schedule: walk its
    compute actions (runtime/schedule.py); a (chunk, mb) holds chunk_bytes[chunk] from its
    forward to the last compute action (B, or a later weight-gradient action) that names it."""
    sched = sched or make_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    actions = [a for a in sched.actions[stage] if a.is_compute or a.kind.value == "W"]
    last = {}
    for i, a in enumerate(actions):
        last[(a.chunk, a.mb)] = i
    live, peak = 0.0, 0.0
    for i, a in enumerate(actions):
        key = (a.chunk, a.mb)
        if a.kind.value == "F":
            live += chunk_bytes.get(a.chunk, 0.0)
            peak = max(peak, live)
        if last[key] == i and a.kind.value != "F":
            live -= chunk_bytes.get(a.chunk, 0.0)
    return peak


def _inflight(schedule: str, pp: int, m: int, v: int, stage: int) -> int:
    return _inflight_stages(schedule, pp, m, v)[stage]


@functools.lru_cache(maxsize=1024)
def _inflight_stages(schedule: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    try:
        return tuple(inflight_bound(schedule, pp, m, v))
    except PlanError:   # a schedule without a stated bound (zero bubble): walk its actions
        plan = Plan(pp=pp, microbatches=m, interleave=v, schedule=schedule)
        sched = make_schedule(schedule, pp, m, v)
        ones = {c: 1.0 for c in range(plan.num_chunks)}
        return tuple(int(peak_inflight(plan, r, ones, sched)) for r in range(pp))


def inflight_count(plan, stage: int) -> int:
    """Most (chunk, microbatch) pairs a stage holds at once (every chunk weighted 1)."""
    return int(peak_inflight(plan, stage, {c: 1.0 for c in range(plan.num_chunks)}))


# ---- from a compiled program ------------------------------------------------------------------
def program_memory(prog) -> list[RankMemory]:
    """Bytes per rank, by component, of a compiled program (a Partitioned/Fused stage), for
    every rank of the mesh."""
    # lazy: start-up: threefold.planner.saved_bytes loads 1 more modules only when this runs
    from threefold.planner.saved_bytes import chunk_saved

    plan = prog.plan
    autocast = COMPUTE_DTYPES.get(getattr(plan, "dtype", "fp32"))
    layout = chunk_layout(plan.schedule)
    local = {}        # fqn -> (local shape, bytes, trainable), from the chunk graphs' placeholders
    saved = {}
    ep = getattr(plan, "ep", 1)
    for chunk in prog.chunks:
        for n in chunk.gm.graph.nodes:
            val = n.meta.get("val")
            if n.op == "placeholder" and tf(n).get("kind") in ("param", "buffer") and hasattr(val, "shape"):
                key = tf(n).get("fqn") or n.name
                shape, nbytes = tuple(val.shape), val.numel() * val.element_size()
                on = on_mesh_of(n)   # ep: a rank holds E/ep of each expert weight (its experts, dim 0)
                if on.dim("ep") == 0 and on.dim("tp") != 0:
                    shape, nbytes = (shape[0] // ep,) + shape[1:], nbytes // ep
                local[key] = (shape, nbytes, tf(n).get("kind") == "param" and not tf(n).get("frozen"))
        saved[chunk.index] = chunk_saved(chunk.gm, autocast, chunk.recompute)
    for chunk in prog.chunks if ep > 1 else ():
        for group in getattr(chunk, "module_experts", ()):
            # experts held as separate modules: ep rank 0's (every ep rank holds as many, alike)
            for fqn, expert in group["owned"].items():
                if expert // (group["experts"] // ep) and fqn in local:
                    shape, _, trainable = local[fqn]
                    local[fqn] = ((0,) + shape[1:], 0, trainable)
    mesh = plan.mesh
    out = []
    for stage in range(plan.pp):
        chunks = [c for c in prog.chunks if stage_of(c.index, plan.pp, layout) == stage]
        names = sorted({f for c in chunks for f in tuple(c.params) + tuple(c.buffers)})
        held = [local[f] for f in names if f in local]
        params = sum(nb for _, nb, _ in held)
        trainable = [shape for shape, _, tr in held if tr]
        grads = sum(math.prod(s) * STATE_BYTES for s in trainable)
        acts = peak_inflight(plan, stage, {c.index: saved[c.index].saved_bytes for c in chunks})
        unsaved = peak_inflight(plan, stage, {c.index: saved[c.index].boundary_unsaved_bytes for c in chunks})
        last = prog.chunks[-1].index
        grad_msg = max((sum(b.nbytes for b in c.outputs) for c in chunks if c.index != last), default=0)
        rerun = max((saved[c.index].recompute_peak_bytes for c in chunks), default=0)
        walk = _walk_peak(plan, stage, {c.index: saved[c.index].saved_bytes for c in chunks},
                          {c.index: saved[c.index].unsaved_bytes for c in chunks})
        units = _stage_units(chunks, local) if plan.zero >= 2 else None
        if units is not None:   # zero>=2: one unit's gradients whole, then its send buffer
            largest = max((n for _, layers in units for n in layers), default=0)
            largest = max([largest] + [u0 for u0, _ in units])
            comm_buffers = 2 * largest * STATE_BYTES
        else:
            comm_buffers = grads if plan.dp * plan.cp > 1 else 0   # the flat all-reduce buffer
        buffers = int(unsaved + grad_msg + comm_buffers)
        d = _zero_ranks(plan)
        for dp_rank in range(plan.dp):
            # the rank's index in its shard group (HSDP: within a replica; ep is the inner axis)
            r = (dp_rank // getattr(plan, "ep", 1)) % d
            opt = optimizer_bytes(trainable, plan, r)
            mine_params, mine_grads, gathered = params, grads, 0
            if plan.zero >= 2:
                owned = sum(owned_elements(sh, d, r) for sh in trainable)
                mine_grads = owned * STATE_BYTES
            if plan.zero >= 3:
                whole = sum(math.prod(sh) for sh in trainable) * STATE_BYTES
                mine_params = params - whole + owned * STATE_BYTES
                layers = sorted((n for _, ls in units for n in ls), reverse=True)
                gathered = (sum(u0 for u0, _ in units) + sum(layers[:2])) * STATE_BYTES
            # cp ranks run the same graph on their share of the sequence (traced at s/cp):
            # the same figures each
            for tp_rank, cp_rank in ((t, c) for t in range(plan.tp) for c in range(plan.cp)):
                peak = mine_params + gathered + opt + max(
                    walk(mine_grads, rerun) + unsaved + grad_msg, mine_grads + comm_buffers)
                out.append(RankMemory(rank=mesh.rank(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=stage), stage=stage,
                                      params=int(mine_params), gathered=int(gathered), grads=int(mine_grads),
                                      optimizer=int(opt), activations=int(acts), recompute=int(rerun),
                                      buffers=buffers, peak=int(peak)))
    return sorted(out, key=lambda r: r.rank)


def _walk_peak(plan, stage: int, saved: dict[int, float], unsaved: dict[int, float]):
    """f(grads, rerun): the most activation and gradient bytes a stage holds at once during
    its forwards and backwards (module doc: `peak`)."""
    sched = make_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    actions = [a for a in sched.actions[stage] if a.is_compute or a.kind.value == "W"]
    last = {(a.chunk, a.mb): i for i, a in enumerate(actions)}

    def walk(grads: float, rerun: float) -> float:
        live, peak, backward_seen = 0.0, 0.0, False
        for i, a in enumerate(actions):
            c = saved.get(a.chunk, 0.0)
            if a.kind.value == "F":
                peak = max(peak, live + c + unsaved.get(a.chunk, 0.0) + (grads if backward_seen else 0.0))
                live += c
                continue
            backward_seen = True
            peak = max(peak, live + grads + rerun)
            if last[(a.chunk, a.mb)] == i:
                live -= c
        return peak
    return walk


def _stage_units(chunks, local: dict) -> list[tuple[int, list[int]]]:
    """Per local chunk: (unit 0's elements, each layer unit's elements), from the compiled
    units (passes/shard_units.py) at their local shapes."""
    out = []
    for c in chunks:
        sizes = [sum(math.prod(local[f][0]) for f in u.params if f in local) for u in c.units]
        out.append((sizes[0] if sizes else 0, sizes[1:]))
    return out


# ---- from the planner's per-layer ModelCost ----------------------------------------------------
def stage_params(model: ModelCost, n_layers: int, stage: int, pp: int, tp: int, ep: int = 1) -> float:
    """Parameters one GPU of this stage holds (a MoE layer's experts: E/ep, each 1/tp)."""
    split = model.layer_params - model.layer_params_repl
    params = n_layers * (split / tp + model.layer_params_repl)
    if model.moe is not None:
        params += n_layers * model.moe.expert_params() / (tp * ep)
    if stage == 0:
        params += model.pre_params / tp + model.pre_params_repl
    if stage == pp - 1:
        params += model.post_params / tp + model.post_params_repl
        if model.tied_embedding and pp > 1:
            params += model.pre_params / tp     # Megatron keeps a copy of the word embedding
    return params


def layer_activation_bytes(model: ModelCost, plan, tokens: float) -> tuple[float, float]:
    """(kept per layer and microbatch, rerun while one layer recomputes) for the plan's
    recompute mode and sp: the ModelCost's per-token figures, which spec_cost.py derives from
    the graph (planner/saved_bytes.py) and gpt_cost.py takes from Megatron's kernels."""
    t = plan.tp
    def per_rank(split, repl):
        return (split / t + (repl / t if plan.sp else repl)) * tokens
    full = per_rank(model.act_split, model.act_repl)
    mode = plan.recompute
    if mode == "none" and getattr(plan, "cp", 1) > 1:
        # ring attention keeps no s x s scores: what selective recompute keeps, nothing rerun
        return per_rank(model.act_selective_split, model.act_selective_repl), 0.0
    if mode == "full":
        return model.act_input * tokens / (t if plan.sp else 1), full
    if mode == "selective":
        kept = per_rank(model.act_selective_split, model.act_selective_repl)
        return kept, full - kept
    return full, 0.0


def stage_memory(model: ModelCost, cfg: Config, stage: int, n_layers: int, params: float) -> float:
    """Bytes of the fullest GPU of a stage (the planner's `fits`), by the rules above."""
    plan = cfg.plan
    t, p, v = plan.tp, plan.pp, plan.interleave
    tokens = cfg.microbatch_size * model.seq_len / getattr(plan, "cp", 1)   # cp: s/cp per rank
    kept, rerun = layer_activation_bytes(model, plan, tokens)
    layers_per_chunk = math.ceil(n_layers / v)
    # Every chunk of a stage holds the same layers here, so the peak is the schedule's count
    # of in-flight (chunk, mb) pairs: the runtime's bound where it states one, else its walk.
    acts = _inflight(plan.schedule, p, plan.microbatches, v, stage) * layers_per_chunk * kept
    if stage == p - 1:
        acts += model.post_act * tokens / (t if model.post_act_split else 1)
    # State: BYTES_PER_PARAM = 16 per parameter, which is both Megatron's 16-bit layout and
    # threefold's (fp32 parameters = master 4, fp32 gradients 4, AdamW moments 8, every dtype).
    # ZeRO shards over the dp_shard ranks d: zero=1 the moments (8 + 8/d), zero=2 the
    # gradients too (4 + 12/d), zero=3 the parameters too (16/d), the rules of program_memory.
    return params * state_bytes_per_param(plan) + gathered_bytes(model, plan, n_layers) + acts + rerun


def state_bytes_per_param(plan) -> float:
    """Bytes of parameter + gradient + AdamW state per parameter on one rank."""
    d = _zero_ranks(plan) if getattr(plan, "zero", 0) else 1
    sharded = {0: 0, 1: ADAM_MOMENTS * STATE_BYTES, 2: (ADAM_MOMENTS + 1) * STATE_BYTES,
               3: BYTES_PER_PARAM}[plan.zero]
    return BYTES_PER_PARAM - sharded + sharded / d


def gathered_bytes(model: ModelCost, plan, n_layers: int) -> float:
    """zero=3's working set per rank: two layers whole (one computing, one prefetched), fp32."""
    if plan.zero < 3 or not n_layers:
        return 0.0
    split = model.layer_params - model.layer_params_repl
    return 2 * (split / plan.tp + model.layer_params_repl) * STATE_BYTES


def _zero_ranks(plan) -> int:
    """The ranks ZeRO shards over: the dp_shard mesh axis (under ep it is inside edp)."""
    return plan.shard_degree // getattr(plan, "ep", 1)
