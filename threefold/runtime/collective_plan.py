"""The communication a training step needs, placed in the schedule as actions.

`plan_collectives(manifest, schedule)` reads what the step must communicate from the
manifest (no compiler needed), and `with_collectives(schedule, plan)` inserts it into each
stage's action list, so the verifier (runtime/simulate.py) checks it and the simulator costs
it like the compute and the point-to-point messages:

  dn      before anything, on the stage holding the loss: the loss's global denominator
          (when it is counted from the data, every rank counts it over the whole global
          batch it holds: no communication, so it is not a synchronisation point)
  ls      as soon as this stage's share of the loss is known: post the loss all-reduce
  ag c.0  zero=3, before chunk c's first forward: gather its unit 0 (parameters read by
          more than one layer, embeddings, the head), kept whole for the chunk's window
  ar c.k  zero=0, after chunk c's last backward (or W): all-reduce gradient bucket k over
  rs c.k  the batch axes; zero=1: reduce-scatter it over dp_shard (and all-reduce the shard
          over dp_replicate: HSDP)
  wg      after the last backward: wait for every gradient reduction of the step
  fr c.0  zero=3, after chunk c's last backward: free unit 0
  ts.k    tied parameter k (the k-th of the manifest's tied parameters, in name order): sum
          its gradient over the stages holding it
  ss      sum sequence-parallel parameters' gradients over tp

Under zero>=2 a chunk's layers are units (passes/shard_units.py) whose gradients are
reduce-scattered per microbatch as backward produces them, and under zero=3 whose
parameters are gathered around each use: that happens inside F and B, in the order of the
chunk's `UnitProgram` (one per chunk and direction, verified here, costed by
`exposed_seconds`), which runtime/fsdp.py follows.

A parameter held by several chunks of one stage (a tied embedding on ZB-V's stage 0) is
reduced with the chunk whose backward ends last. Buckets are fixed from the manifest, so
every rank of a stage reduces the same tensors in the same order (a parameter that got no
gradient contributes zeros).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from threefold.runtime.mesh import BATCH_AXES
from threefold.runtime.schedule import Action, Kind, Schedule, collective
from threefold.runtime.ties import tied_param_stages

BUCKET_BYTES = 25 * 2**20   # gradient reduction bucket (Megatron/DDP-like)
GRAD_BYTES = 4              # gradients are reduced in fp32 under every dtype


@dataclass(frozen=True)
class Bucket:
    chunk: int
    index: int
    fqns: tuple[str, ...]
    numel: int                # local elements reduced
    axes: str = BATCH_AXES    # summed over these ranks: the batch axes; an expert's, the ranks holding it (edp)


@dataclass(frozen=True)
class Unit:
    chunk: int
    index: int                # 0: kept whole for the chunk's window; 1..: a layer
    name: str
    fqns: tuple[str, ...]
    numel: int                # local (per tp rank) elements of its full parameters


@dataclass(frozen=True)
class UnitProgram:
    """The order a chunk's layer units communicate in one forward or backward: steps
    ("ag", u) gather unit u, ("run", u) computes with it, ("rs", u) reduce-scatters its
    gradients, ("fr", u) frees it. Prefetch: the next unit's gather is issued before the
    current unit runs."""
    chunk: int
    phase: str                # "forward" or "backward"
    steps: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return " ".join(f"{op}{u}" for op, u in self.steps)


@dataclass(frozen=True)
class CollectivePlan:
    zero: int
    batch_axes: str                               # gradients of replicated parameters sum here
    buckets: dict[int, tuple[Bucket, ...]]        # stage -> zero 0/1 buckets, in issue order
    units: dict[int, tuple[Unit, ...]] = field(default_factory=dict)   # chunk -> units (zero>=2)
    ties: tuple[tuple[str, tuple[int, ...]], ...] = ()   # (FQN, stages), index = ts.k
    sp: tuple[str, ...] = ()                      # parameters whose gradients sum over tp
    has_loss: bool = True
    graph_denominator: bool = False
    numel: dict[str, int] = field(default_factory=dict)   # FQN -> local elements

    def bucket(self, stage: int, a: Action) -> Bucket:
        return next(b for b in self.buckets[stage] if b.chunk == a.chunk and b.index == a.mb)

    def program(self, chunk: int, phase: str) -> UnitProgram:
        return unit_program(chunk, phase, len(self.units.get(chunk, ())), self.zero)

    def bytes_of(self, stage: int, a: Action) -> int:
        """Bytes one rank sends for a collective action (its input's size)."""
        if a.kind in (Kind.ALL_REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS):
            return self.bucket(stage, a).numel * GRAD_BYTES
        if a.kind in (Kind.UNSHARD, Kind.RESHARD):
            unit = self.units[a.chunk][a.mb]
            return unit.numel * GRAD_BYTES if a.kind is Kind.UNSHARD else 0
        if a.kind is Kind.TIED_SUM:
            return self.numel.get(self.ties[a.mb][0], 0) * GRAD_BYTES
        if a.kind is Kind.SP_SUM:
            return sum(self.numel.get(f, 0) for f in self.sp) * GRAD_BYTES
        return 8 if a.kind is Kind.LOSS else 0   # dn counts the global batch locally


def plan_collectives(manifest, schedule: Schedule) -> CollectivePlan:
    """What `schedule`'s step communicates for this manifest (the same on every rank)."""
    plan = manifest.plan
    frozen = set(manifest.frozen)
    numel = {fqn: math.prod(shape) for fqn, shape in manifest.local_shapes.items()}
    buckets: dict[int, tuple[Bucket, ...]] = {}
    if plan.zero < 2:
        for stage in range(schedule.pp):
            buckets[stage] = _stage_buckets(manifest, schedule, stage, frozen, numel)
    units: dict[int, tuple[Unit, ...]] = {}
    if plan.zero >= 2:
        for c in manifest.chunks:
            units[c.index] = tuple(Unit(c.index, k, name, tuple(fqns), sum(numel.get(f, 0) for f in fqns))
                                   for k, (name, fqns) in enumerate(c.units))
    ties = tuple(sorted(tied_param_stages(manifest.chunks, schedule.pp, schedule.layout).items()))
    ties = tuple((f, s) for f, s in ties if f not in frozen)
    return CollectivePlan(zero=plan.zero, batch_axes=BATCH_AXES, buckets=buckets, units=units, ties=ties,
                          sp=tuple(manifest.tp_grad_sync), has_loss=manifest.has_loss,
                          graph_denominator=manifest.loss.denominator == "graph", numel=numel)


def _grads_done(schedule: Schedule) -> Kind:
    return Kind.WEIGHT if schedule.splits_backward else Kind.BACKWARD


def _last_backward(schedule: Schedule, stage: int) -> dict[int, int]:
    """Local chunk -> position of its last backward (W under a split schedule)."""
    done = _grads_done(schedule)
    return {a.chunk: i for i, a in enumerate(schedule.actions[stage]) if a.kind is done}


def _stage_buckets(manifest, schedule: Schedule, stage: int, frozen: set, numel: dict) -> tuple[Bucket, ...]:
    last = _last_backward(schedule, stage)
    local = [c for c in manifest.chunks if c.stage == stage]
    owner: dict[str, int] = {}
    for c in sorted(local, key=lambda c: last.get(c.index, -1)):
        for fqn in c.params:
            if fqn not in frozen:
                owner[fqn] = c.index
    out: list[Bucket] = []
    # under ep an expert's gradient sums over the ranks holding the same experts (edp), a
    # dense one over every batch rank: separate buckets, expert ones after the chunk's dense
    experts = manifest.expert_weights()   # placed ep S(0), or whole on their ep rank
    for c in sorted(local, key=lambda c: last.get(c.index, -1)):
        k = 0
        for axes, expert in ((BATCH_AXES, False), ("edp", True)):
            fqns = [f for f, o in owner.items() if o == c.index and (f in experts) == expert]
            current: list[str] = []
            size = 0
            for f in fqns:
                n = numel.get(f, 0)
                if current and (size + n) * GRAD_BYTES > BUCKET_BYTES:
                    out.append(Bucket(c.index, k, tuple(current), size, axes))
                    k, current, size = k + 1, [], 0
                current.append(f)
                size += n
            if current:
                out.append(Bucket(c.index, k, tuple(current), size, axes))
                k += 1
    return tuple(out)


def unit_program(chunk: int, phase: str, n_units: int, zero: int) -> UnitProgram:
    """Layer units 1..n-1 (unit 0 is gathered by the chunk-level `ag c.0`): forward runs
    them in order, backward in reverse; zero=3 gathers one unit ahead and frees each after
    its use; backward reduce-scatters each unit's gradients (zero>=2)."""
    layers = list(range(1, n_units))
    if phase == "backward":
        layers.reverse()
    steps: list[tuple[str, int]] = []
    gather = zero >= 3
    if gather and layers:
        steps.append(("ag", layers[0]))
    for i, u in enumerate(layers):
        if gather and i + 1 < len(layers):
            steps.append(("ag", layers[i + 1]))   # prefetch: before this unit's compute
        steps.append(("run", u))
        if phase == "backward":
            steps.append(("rs", u))
        if gather:
            steps.append(("fr", u))
    if phase == "backward" and n_units:
        steps.append(("rs", 0))   # unit 0's gradients, once the chunk's backward is done
    return UnitProgram(chunk, phase, tuple(steps))


def with_collectives(schedule: Schedule, cplan: CollectivePlan, train: bool = True) -> Schedule:
    """`schedule` with the step's collectives inserted (see the module docstring)."""
    last_chunk = schedule.num_chunks - 1
    loss_stage = schedule.stage_of(last_chunk)
    out: list[list[Action]] = []
    for stage, acts in enumerate(schedule.actions):
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        head: list[Action] = []
        if cplan.has_loss and stage == loss_stage:
            head.append(collective(Kind.LOSS_DENOMINATOR))
        firsts = {}
        for i, a in enumerate(acts):
            if a.kind is Kind.FORWARD:
                firsts.setdefault(a.chunk, i)
        if cplan.zero >= 3:
            for c, i in firsts.items():
                before.setdefault(i, []).append(collective(Kind.UNSHARD, c, 0))
        if cplan.has_loss:
            lasts = [i for i, a in enumerate(acts) if a.kind is Kind.FORWARD and a.chunk == last_chunk]
            if lasts:
                after.setdefault(lasts[-1], []).append(collective(Kind.LOSS))
            else:
                head.append(collective(Kind.LOSS))
        done_at = _last_backward(schedule, stage) if train else {
            a.chunk: i for i, a in enumerate(acts) if a.kind is Kind.FORWARD}
        if train and cplan.zero < 2:
            kind = Kind.ALL_REDUCE_GRADS if cplan.zero == 0 else Kind.REDUCE_SCATTER_GRADS
            for b in cplan.buckets.get(stage, ()):
                if b.chunk in done_at:
                    after.setdefault(done_at[b.chunk], []).append(collective(kind, b.chunk, b.index))
        tail: list[Action] = []
        if train:
            tail.append(collective(Kind.WAIT_GRADS))
        if cplan.zero >= 3:
            for c in sorted(done_at, key=done_at.get):
                if train:
                    tail.append(collective(Kind.RESHARD, c, 0))
                else:
                    after.setdefault(done_at[c], []).append(collective(Kind.RESHARD, c, 0))
        if train:
            tail += [collective(Kind.TIED_SUM, index=k) for k, (_, stages) in enumerate(cplan.ties)
                     if stage in stages]
            if cplan.sp:
                tail.append(collective(Kind.SP_SUM))
        lst = list(head)
        for i, a in enumerate(acts):
            lst += before.get(i, [])
            lst.append(a)
            lst += after.get(i, [])
        out.append(lst + tail)
    return Schedule(name=schedule.name, pp=schedule.pp, v=schedule.v, m=schedule.m, actions=out,
                    layout=schedule.layout)


def exposed_seconds(program: UnitProgram, compute: dict[int, float], comm: dict[int, float]) -> float:
    """Time of one direction of a chunk's units with one compute and one comm stream:
    compute of unit u waits for its gather; gathers are issued in program order. The
    result minus the compute alone is the communication the prefetch did not hide."""
    t_compute = t_comm = 0.0
    ready: dict[int, float] = {}
    for op, u in program.steps:
        if op == "ag":
            t_comm = max(t_comm, t_compute) + comm.get(u, 0.0)
            ready[u] = t_comm
        elif op == "run":
            t_compute = max(t_compute, ready.get(u, 0.0)) + compute.get(u, 0.0)
        elif op == "rs":
            t_comm = max(t_comm, t_compute) + comm.get(u, 0.0) / 2   # reduce-scatter: half an all-reduce
    return max(t_compute, t_comm)
