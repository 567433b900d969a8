"""Process groups from the mesh, point-to-point transfers, and failure reporting.

Groups are plain values in a `Groups` object passed to whoever needs them; nothing here is
global. Every blocking wait is bounded by the process-group timeout (THREEFOLD_TIMEOUT,
default 60 s). When a transfer fails, the error names this rank, the peer rank and what
was being moved, and adds whatever a failed rank posted on the shared store, so a dead or
failing rank makes the others fail loudly and say who.
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime.mesh import Mesh

FAILURE_KEY = "threefold/failure"


MAX_TIMEOUT_S = 1e6      # ~11.6 days: beyond it timedelta and gloo's milliseconds overflow


# While a step may compile (plan compile=inductor, runtime/compiled.py), waits on peers are
# bounded by this longer timeout instead of the process group's: [timedelta] or [] (none).
# Gloo's point-to-point waits take their bound from the wait call, not the group's setting.
wait_grace: list = []


def wait_work(work) -> None:
    """work.wait(), bounded by the compile grace where one is set."""
    if wait_grace:
        work.wait(wait_grace[0])
    else:
        work.wait()


def default_timeout() -> timedelta:
    """THREEFOLD_TIMEOUT seconds (default 60): how long a collective or the rendezvous waits."""
    return _timeout_of(os.environ.get("THREEFOLD_TIMEOUT", "60"))


@functools.lru_cache(maxsize=8)    # a shared-memory wait asks per message: parse once per value
def _timeout_of(text: str) -> timedelta:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_TIMEOUT_S):     # also nan
        raise PlanError(f"THREEFOLD_TIMEOUT={text!r} is invalid: give seconds above 0 and at most "
                        f"{MAX_TIMEOUT_S:.0f}, e.g. 60")
    return timedelta(seconds=seconds)


class RankFailure(RuntimeError):
    """Another rank died or failed; the message names it."""


# The groups every rank builds: one per mesh axis or alias that collectives run over.
# (A name "axis#tag" asks for a second group over the same ranks, so that two streams of
# collectives, ZeRO-3's all-gathers and its reduce-scatters, are ordered independently.)
# "pp+tp": the ranks whose gradients differ when every batch rank holds the same ones (the
# gradient norm's sum without ZeRO or ep: runtime/grad_norm.py)
GROUP_AXES = ("tp", "dp", "pp", "dp_shard", "dp_replicate", "ep", "edp", "cp", "dp+cp", "pp+tp")


@dataclass
class Groups:
    """This rank's process groups, built from the mesh: `groups.of("dp")` (None when the
    group has one rank), `groups.tp` and friends for the axes every job has, and the
    tied-parameter groups over stage sets."""
    mesh: Mesh
    rank: int
    by_axes: dict[str, object] = field(default_factory=dict)   # axis or alias -> dist.ProcessGroup
    ties: dict[tuple[int, ...], object] = field(default_factory=dict)  # stages -> group

    def of(self, names: str):
        return self.by_axes.get(names)

    def size(self, names: str) -> int:
        return self.mesh.size(names)

    @property
    def tp(self):
        return self.by_axes.get("tp")

    @property
    def dp(self):
        return self.by_axes.get("dp")

    @property
    def pp(self):
        return self.by_axes.get("pp")


# Groups made in this process: (default group, rank list, purpose, timeout) -> group.
_made_groups: dict = {}


def _group(ranks, purpose: str):
    """dist.new_group(ranks), made once per process and default group. Every rank calls it
    for every rank list in the same order, so every rank hits or misses alike. Without it each
    parallelize (a test suite, the zoo matrix, a recompile) added its groups to the last ones',
    each holding the backend's threads: 8 gloo ranks reached 1,059 threads each after the
    zoo's 107 compiles, and the machine's load average 1,700."""
    world = dist.distributed_c10d._get_default_group()
    timeout = default_timeout()
    for key in [k for k, (w, _) in _made_groups.items() if w is not world]:   # a new job's default group
        del _made_groups[key]
    key = (id(world), tuple(ranks), purpose, timeout)
    if key not in _made_groups:
        _made_groups[key] = (world, dist.new_group(list(ranks), timeout=timeout))
    return _made_groups[key][1]


def build_groups(mesh: Mesh, rank: int, tie_stage_sets: list[tuple[int, ...]] = (),
                 axes: tuple[str, ...] = GROUP_AXES) -> Groups:
    """Create every group on every rank in the same order (torch.distributed requires it).
    Axes whose groups are the same rank sets (dp_shard = dp without HSDP) share one group."""
    groups = Groups(mesh, rank)
    made: dict[tuple, object] = {}
    for name in axes:
        base, _, tag = name.partition("#")
        partition = tuple(tuple(g) for g in mesh.groups(base))
        if len(partition[0]) == 1:
            continue
        key = (partition, tag)
        if key not in made:
            mine = None
            for ranks in partition:
                g = _group(ranks, tag)
                if rank in ranks:
                    mine = g
            made[key] = mine
        groups.by_axes[name] = made[key]
    for stages in sorted(set(tie_stage_sets)):
        for r in range(mesh.world_size):
            base = mesh.coord(r)
            if base.pp != 0:
                continue
            ranks = [mesh.moved(r, pp=s) for s in stages]
            g = _group(ranks, "ties")
            if rank in ranks:
                groups.ties[stages] = g
    return groups


# The store failures are posted on. The local launcher hosts one store in the parent and
# registers each rank's client here, so the parent reads and writes the same key; under
# torchrun the default process group's store is used.
_failure_store: list = []


def use_failure_store(store) -> None:
    _failure_store[:] = [store]


def _store():
    return _failure_store[0] if _failure_store else dist.distributed_c10d._get_default_store()


def post_failure(message: str) -> None:
    """Tell the other ranks why this one is going down (best effort). The first report
    stays (later ones are mostly echoes of it); the launcher overwrites it with the root
    cause when it sees one (a rank that died or is stopped)."""
    try:
        store = _store()
        store.compare_set(FAILURE_KEY, "", message.split(". Reported: ")[0])
    except Exception:
        pass


def posted_failure() -> str | None:
    try:
        store = _store()
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        pass
    return None


def _who(peer) -> str:
    """'rank 3' for a peer rank, 'ranks [0, 1]' for a process group (None: every rank)."""
    if isinstance(peer, int):
        return f"rank {peer}"
    if peer is _PEERS:
        return "its peers"
    try:
        ranks = dist.get_process_group_ranks(peer if peer is not None else dist.group.WORLD)
    except Exception:
        return "its group"
    return f"ranks {sorted(ranks)}"


def _fail(what: str, peer, exc: Exception) -> RankFailure:
    """What failed, with whom, why (one line), and what a failed rank posted, if anything."""
    me = dist.get_rank()
    other = posted_failure()
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]  # gloo's source path
    who = _who(peer)
    blame = f"{who} died, failed or is stuck" if isinstance(peer, int) else f"one of {who} died, failed or is stuck"
    msg = f"rank {me}: {what} {who} failed ({text[:160]}); {blame}"
    if other:
        msg += f". Reported: {other}"
    return RankFailure(msg)


def in_graph_failure(exc: BaseException, what: str) -> RankFailure | None:
    """A collective inside a compiled graph that failed (tp_ops' collectives, traced as
    functional ones under compile=inductor: no comm call to name the peer), as comm's own
    failures read: what, with whom, and what a failed rank posted. None for any other error."""
    text = str(exc)
    if isinstance(exc, RankFailure) or not (isinstance(exc, dist.DistError) or "c10d_functional" in text):
        return None
    if "API call failed" in text:   # the C++ wrapper's shim: the cause stayed in the collective
        exc = RuntimeError("its wait failed")
    return _fail(f"a collective in {what} (a compiled graph) with", None, exc)


# runtime/trace.py's Recorder while a step is traced. Empty, the functions marked
# @_recorded are plain calls: no clock is read.
_recorders: list = []


def _recorded(fn):
    """Let a traced step time this collective or wait (runtime/trace.Recorder.comm_call)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _recorders:
            return fn(*args, **kwargs)
        return _recorders[-1].comm_call(fn, args, kwargs)
    return call


class PendingSend:
    """Sends posted with isend: the buffers stay alive until every transfer completes."""

    def __init__(self, works: list, buffers: list[torch.Tensor], peer: int, what: str):
        self.works, self.buffers, self.peer, self.what = works, buffers, peer, what

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    @_recorded
    def wait(self) -> None:
        try:
            for w in self.works:
                wait_work(w)
        except Exception as exc:
            raise _fail(f"sending {self.what} to", self.peer, exc) from None
        self.buffers = []


# A send already complete when posted (shared memory copies it into the ring at once): one
# object for all of them, which the engine need not keep (PendingSend.wait does nothing).
SENT = PendingSend([], [], -1, "a message already copied out")


def drop_finished(sends: list[PendingSend]) -> None:
    """Remove the completed sends from the front of `sends` (posting order). Sends to one
    peer complete in order, so checking from the oldest and stopping at the first pending one
    frees nearly as much as checking all, at a fraction of the calls."""
    k = 0
    while k < len(sends) and sends[k].done():
        k += 1
    if k:
        del sends[:k]


def send(tensors: list[torch.Tensor], peer: int, what: str, local=None) -> PendingSend:
    """Post the sends without waiting (verified schedules stay deadlock-free either way;
    not blocking keeps the interleaved schedule at its simulated makespan). `local`
    (runtime/local_p2p.Links): through shared memory where a channel to `peer` takes it."""
    if local is not None:
        sent = local.send(tensors, peer, what)
        if sent is not None:
            return sent
    buffers = [t.detach().contiguous() for t in tensors]
    try:
        works = [dist.isend(b, dst=peer) for b in buffers]
    except Exception as exc:
        raise _fail(f"sending {what} to", peer, exc) from None
    return PendingSend(works, buffers, peer, what)


class PendingRecv:
    """Receives posted with irecv (runtime/receives.py says when): `wait()` gives the tensors."""

    def __init__(self, works: list, tensors: list[torch.Tensor], peer: int, what: str):
        self.works, self.tensors, self.peer, self.what = works, tensors, peer, what

    def wait(self) -> list[torch.Tensor]:
        try:
            for w in self.works:
                wait_work(w)
        except Exception as exc:
            raise _fail(f"receiving {self.what} from", self.peer, exc) from None
        return self.tensors


def post_recv(specs: list[tuple[tuple[int, ...], torch.dtype]], peer: int, what: str,
              device: torch.device, pool=None, local=None) -> PendingRecv:
    """Post the receives without waiting; the bytes land while this rank computes.
    `pool` (runtime/buffer_pool.BufferPool): receive into buffers kept across microbatches.
    `local` (runtime/local_p2p.Links): through shared memory where a channel from `peer` takes it."""
    if local is not None:
        posted = local.post_recv(specs, peer, what, device, pool)
        if posted is not None:
            return posted
    tensors = [pool.take(shape, dtype, device) if pool is not None else torch.empty(shape, dtype=dtype, device=device)
               for shape, dtype in specs]
    try:
        works = [dist.irecv(t, src=peer) for t in tensors]
    except Exception as exc:
        raise _fail(f"receiving {what} from", peer, exc) from None
    return PendingRecv(works, tensors, peer, what)


def recv(specs: list[tuple[tuple[int, ...], torch.dtype]], peer: int, what: str,
         device: torch.device) -> list[torch.Tensor]:
    out = []
    try:
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=peer)
            out.append(t)
    except Exception as exc:
        raise _fail(f"receiving {what} from", peer, exc) from None
    return out


@_recorded
def all_reduce(t: torch.Tensor, group, what: str, async_op: bool = False, op=None):
    """dist.all_reduce over `group` (None: every rank); a failure names the group and what."""
    try:
        return dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group,
                               async_op=async_op)
    except Exception as exc:
        raise _fail(f"all-reduce of {what} with", group, exc) from None


@_recorded
def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group, what: str) -> None:
    try:
        dist.all_gather(parts, t, group=group)
    except Exception as exc:
        raise _fail(f"all-gather of {what} with", group, exc) from None


@_recorded
def all_to_all(out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
               what: str) -> None:
    """dist.all_to_all_single with uneven splits (rows of dim 0) over `group`."""
    try:
        dist.all_to_all_single(out, t, out_splits, in_splits, group=group)
    except Exception as exc:
        raise _fail(f"all-to-all of {what} with", group, exc) from None


_PEERS = object()   # a wait whose group the caller did not say


@_recorded
def wait(work, what: str, group=_PEERS) -> None:
    try:
        wait_work(work)
    except Exception as exc:
        raise _fail(f"waiting for {what} with", group, exc) from None
