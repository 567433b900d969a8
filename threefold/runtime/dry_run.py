"""Dry-run ranks of a job that does not exist: each rank's program at full world size, on
torch's fake process-group backend and meta tensors, for one training step.

`dry_run_rank(manifest, source, rank, batch)` joins a fake world of the plan's size as
`rank` (torch.distributed's "fake" backend: every collective completes at once and moves
no bytes), assembles the rank exactly as a real job does (runtime/assemble.py: its chunk
modules, process groups, verified schedule, engine) on the meta device, runs one training
step (forward, backward, every collective of every axis) and the optimizer's step, and
returns what it issued: every collective and point-to-point operation in order
(runtime/comm_log.py, the same recorder a real run can use), the process groups it built,
its store operations, and its memory by category (torch's MemTracker over meta tensors:
parameters, gradients, optimizer state, activations, temporaries).

Nothing here reads data: scalars a step reads back from a tensor (the loss, a token count)
are stand-ins on meta tensors (`_MetaScalars`), so control flow that depends on data takes
the data-independent path; expert routing is taken as balanced (runtime/experts.py).
`runtime/dry_check.py` cross-checks the ranks' logs over the whole job.
"""
from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from threefold.runtime.comm_log import CommLog, CommOp, record_comm
from threefold.runtime.meta_attention import SDPA_FUNCS, sdpa_on_meta
from threefold.runtime.assemble import assemble_rank
from threefold.runtime.optimizers import make_optimizer
from threefold.runtime.store_rounds import add_ops, backend_store_ops
from threefold.runtime.memory_meter import torch_optimizer
from threefold.runtime.memory_meter import StepMeter, state_bytes
import time
from threefold.runtime.dry_check import Digits, check_classes, check_job, classes_of, relative_ops
from threefold.runtime.dry_check import P2P, _describe_rel
from threefold.runtime.dry_order import find_deadlock, job_groups
from threefold.runtime.loader import import_source
from threefold.runtime.dry_check import CheckResult

# Timing in a dry run means nothing; THREEFOLD_* knobs that open shared memory are off.
_ENV = {"THREEFOLD_LOCAL_P2P": "0", "THREEFOLD_LOCAL_REDUCE": "0"}


@dataclass
class RankRun:
    """What one rank issued in its dry-run step."""
    rank: int
    ops: list[CommOp]
    groups_built: int            # dist.new_group calls on this rank
    groups_joined: int           # groups this rank is a member of
    store_ops: dict[str, int]    # store calls by kind during init + assembly + step (runtime/store_rounds.py)
    memory: dict[str, int] = field(default_factory=dict)   # category -> bytes at the peak
    error: str | None = None     # the rank failed to assemble or step (one line)

    @property
    def peak_bytes(self) -> int:
        return self.memory.get("total", 0)


class CountingStore(dist.Store):
    """A store that counts the calls made on it (a job's store round trips) by kind, over
    `inner`; without one (a dry run: a fake world has no peers to wait for), over an
    in-memory HashStore whose waits return at once."""

    def __init__(self, inner=None):
        super().__init__()
        self.fake = inner is None
        self.inner = dist.HashStore() if inner is None else inner
        self.calls: dict[str, int] = {}

    def _n(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def set(self, key, value):
        self._n("set")
        return self.inner.set(key, value)

    def get(self, key):
        self._n("get")
        return self.inner.get(key)

    def add(self, key, value):
        self._n("add")
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._n("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self._n("check")
        return self.inner.check(keys)

    def wait(self, keys, *args):
        self._n("wait")
        return True if self.fake else self.inner.wait(keys, *args)

    def delete_key(self, key):
        self._n("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self):
        self._n("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return None if self.fake else self.inner.set_timeout(timeout)


_SCALAR_READS = {torch.Tensor.item: 1, torch.Tensor.__float__: 1.0, torch.Tensor.__int__: 1,
                 torch.Tensor.__index__: 1, torch.Tensor.__bool__: True}


_ON_META = frozenset(_SCALAR_READS) | {torch.Tensor.tolist} | frozenset(SDPA_FUNCS)   # what _MetaScalars changes


class _MetaScalars(TorchFunctionMode):
    """Scalars read from meta tensors: 1 (a loss, a count, a flag) and lists of ones, so a
    step on meta tensors runs its data-independent path; attention on meta takes the kernel a
    real device takes (runtime/meta_attention.py). Real tensors are untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ON_META and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            if func in _SCALAR_READS:
                return _SCALAR_READS[func]
            if func is torch.Tensor.tolist:
                return torch.ones(args[0].shape, dtype=torch.int64).tolist()
            return sdpa_on_meta(func, *args, **kwargs)
        return func(*args, **kwargs)


class _MetaAutocast(torch.autocast):
    """torch.autocast, which knows no meta device: a meta step asks for the CPU's (the
    regions it turns off or on are the same; meta tensors are not cast by it)."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


@contextlib.contextmanager
def _meta_autocast():
    saved = torch.autocast
    torch.autocast = _MetaAutocast
    try:
        yield
    finally:
        torch.autocast = saved


class DrySource:
    """Where `assemble_rank` gets a dry-run rank's modules: the generated sources; weights
    stay meta (shapes only)."""

    def __init__(self, sources: dict[str, str], root: str = "<threefold-dry-run>"):
        self.sources, self.root = sources, root
        self._classes: dict[tuple, type] = {}

    def chunk_class(self, entry):
        key = (entry.module, entry.cls)
        if key not in self._classes:
            module = import_source(self.sources[entry.module], f"{self.root}/{entry.module}")
            self._classes[key] = getattr(module, entry.cls)
        return self._classes[key]

    def load_weights(self, module, entry, tp_rank: int, device) -> None:
        return None


def meta_batch(batch: tuple) -> tuple:
    """The global batch as meta tensors of the same shapes and dtypes."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t
                 for t in batch)


def dry_run_rank(manifest, source, rank: int, batch: tuple, optimizer_cls=torch.optim.Adam,
                 memory: bool = True, swap_at: int | None = None, backend: str = "gloo") -> RankRun:
    """One training step of `rank` in a fake world of the plan's size (see the module doc).
    `swap_at` (fault injection, tests): runtime/comm_log.record_comm's. `backend`: whose
    rendezvous the store counts include (gloo or nccl)."""
    world = manifest.mesh.world_size
    if dist.is_initialized():
        raise RuntimeError("dry_run_rank needs a process without a process group (it builds a fake one)")
    saved_env = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    store = CountingStore()
    run = RankRun(rank, [], 0, 0, {})
    try:
        with record_comm(world, fake=True, swap_at=swap_at) as log, _MetaScalars(), _meta_autocast():
            dist.init_process_group("fake", store=store, rank=rank, world_size=world)
            try:
                engine = assemble_rank(manifest, source, rank, torch.device("meta"))
                opt = make_optimizer(engine, optimizer_cls, None, lr=1e-3, foreach=False)
                if memory:
                    run.memory = _step_memory(engine, opt, batch)
                else:
                    _step(engine, opt, batch)
            except Exception as exc:   # named, not raised: the job's other ranks are still checked
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                run.error = f"{type(exc).__name__}: {text[:300]}"
            finally:
                dist.destroy_process_group()
        _fill(run, log, store, backend)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return run


def _fill(run: RankRun, log: CommLog, store: CountingStore, backend: str) -> None:
    """What the rank issued, and its store calls: those made through the store (threefold's
    own, c10d's) plus the real backend's rendezvous of every group it joined, the default
    group first (the fake backend makes none: runtime/store_rounds.py)."""
    run.ops = log.ops
    run.groups_built, run.groups_joined = log.groups_built, log.groups_joined
    joined = [tuple(range(log.world))] + log.joined
    run.store_ops = add_ops(store.calls, backend_store_ops(joined, run.rank, backend))


def _step(engine, opt, batch: tuple) -> None:
    opt.zero_grad()
    engine.step(batch, train=True)
    opt.step()


def warm_optimizer_state(opt) -> None:
    """Give the optimizer the state it holds from its second step on (AdamW's moments): one
    update of the torch optimizer inside the wrappers with zero gradients, on the tensors it
    updates and nothing else (no collective). A step's peak is measured with it in place,
    as every step but the first runs (the first allocates it after backward, when the
    activations are gone, so measuring the first step alone misses it)."""
    inner = torch_optimizer(opt)
    if inner is None:
        return
    cold = [p for g in inner.param_groups for p in g["params"] if p not in inner.state and p.grad is None]
    if not cold:
        return
    for p in cold:
        p.grad = torch.zeros_like(p)
    try:
        with torch.no_grad():
            inner.step()
    finally:
        for p in cold:
            p.grad = None


def _step_memory(engine, opt, batch: tuple) -> dict[str, int]:
    """One steady-state step (the optimizer's state in place: `warm_optimizer_state`) with
    every tensor it allocates counted (meta tensors count their full size): bytes at the
    step's peak in the memory model's categories (planner/memory.py): params (parameters
    and module buffers), grads, optimizer, activations (autograd's saved values and the
    step's temporaries) and buffers (communication; runtime/memory_meter.py says which)."""
    warm_optimizer_state(opt)
    params = {id(p): p for m in engine.modules.values() for p in m.parameters()}
    buffers = {id(b): b for m in engine.modules.values() for b in m.buffers()}
    held_state = state_bytes(opt)
    meter = StepMeter(list(params.values()), opt)
    with meter:
        _step(engine, opt, batch)
    static = (sum(p.numel() * p.element_size() for p in params.values())
              + sum(b.numel() * b.element_size() for b in buffers.values()))
    at_peak = meter.at_peak
    out = {"params": static, "grads": at_peak["grads"], "optimizer": held_state + at_peak["optimizer"],
           "activations": max(0, meter.peak - at_peak["grads"] - at_peak["optimizer"] - at_peak["buffers"]),
           "buffers": at_peak["buffers"]}
    out["total"] = static + held_state + meter.peak
    return out


ALL_RANKS_UP_TO = 64    # worlds up to this size dry-run every rank; larger ones by stage class


@dataclass
class JobReport:
    """A whole job's dry run: the ranks run, the cross-check, and the rank classes used."""
    world: int
    runs: dict[int, RankRun]                # the ranks dry-run (all, or each class's witnesses)
    classes: bool                           # True: one class per stage stood for its ranks
    check: object                           # runtime/dry_check.CheckResult
    class_mismatches: list                  # witnesses of one class that issued different lists
    seconds: float = 0.0
    too_big: list[str] = field(default_factory=list)   # ranks over the device capacity, with categories

    @property
    def errors(self) -> dict[int, str]:
        return {r: run.error for r, run in self.runs.items() if run.error}

    @property
    def ok(self) -> bool:
        return not self.errors and self.check.ok and not self.class_mismatches and not self.too_big


def dry_run_job(manifest, source, batch: tuple, all_ranks: bool | None = None, optimizer_cls=torch.optim.Adam,
                capacity_bytes: int | None = None, progress=None, swaps: dict[int, int] | None = None) -> JobReport:
    """Dry-run the job's ranks (every rank, or one class per stage with its two witnesses:
    runtime/dry_check.py says why that is enough) and cross-check what they issued.
    `swaps` {rank: k} (fault injection, tests): that rank swaps its collectives k and k+1."""

    start = time.perf_counter()
    digits = Digits(manifest.mesh.axes)
    if all_ranks is None:
        all_ranks = digits.world <= ALL_RANKS_UP_TO
    if all_ranks:
        ranks, witnesses = list(range(digits.world)), {}

        def class_of(r):
            return r
    else:
        reps, witnesses, class_of = classes_of(digits)
        ranks = sorted(set(reps) | {w for ws in witnesses.values() for w in ws})
    runs: dict[int, RankRun] = {}
    rel: dict[int, list] = {}
    # memory is measured on each class's first witness; its other witness runs the same
    # program (same chunk modules, shapes and schedule: check_classes proves the same list)
    # and reports the first's figures
    unmetered = {w: q for q, ws in witnesses.items() for w in ws}
    for i, r in enumerate(ranks):
        run = dry_run_rank(manifest, source, r, batch, optimizer_cls, swap_at=(swaps or {}).get(r),
                           memory=r not in unmetered)
        if r in unmetered and unmetered[r] in runs:
            run.memory = dict(runs[unmetered[r]].memory)
        rel[r] = relative_ops(run.ops, r, digits)
        runs[r] = run
        if progress is not None:
            progress(i + 1, len(ranks), run)
        if i % 16 == 15:   # a step's autograd graph holds cycles: return them now and then, not per rank
            gc.collect()
    class_mismatches = check_classes(rel, witnesses)
    if any(run.error for run in runs.values()):
        check = CheckResult()
    else:
        check = check_job(rel, class_of, digits)
        if check.ok:
            check.deadlock = order_check(rel, class_of, digits)
    report = JobReport(digits.world, runs, not all_ranks, check, class_mismatches)
    if capacity_bytes is not None:
        report.too_big = over_capacity(runs, capacity_bytes)
    report.seconds = time.perf_counter() - start
    return report


def order_check(rel: dict[int, list], class_of, digits):
    """The collectives of every rank run in their issue orders (runtime/dry_order.py): a
    Deadlock naming two ranks, or None."""
    colls: dict[int, list] = {}

    def describe(rank: int, i: int) -> str:
        q = class_of(rank)
        if q not in colls:
            colls[q] = [op for op in rel[q] if op[0] not in P2P and op[6]]
        return _describe_rel(colls[q][i], rank, digits) if i < len(colls[q]) else "nothing"
    return find_deadlock(job_groups(rel, class_of, digits), describe)


def over_capacity(runs: dict[int, RankRun], capacity_bytes: int) -> list[str]:
    """The ranks whose step peak exceeds the device's memory, each with its categories."""
    out = []
    for r, run in sorted(runs.items()):
        if run.peak_bytes > capacity_bytes:
            cats = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in run.memory.items() if k != "total" and v)
            out.append(f"rank {r} needs {run.peak_bytes / 2**30:.2f} GiB > {capacity_bytes / 2**30:.2f} GiB "
                       f"(GiB: {cats})")
    return out
