"""ZeRO-2 and ZeRO-3 (FSDP): gradients, and under zero=3 parameters, sharded over dp_shard.

Every trainable parameter is split into row ranges over the dp_shard ranks (runtime/zero.py
`split_rows`: the same rows ZeRO-1 uses, so checkpoints write the same pieces). A chunk's
parameters are grouped into units (passes/shard_units.py; runtime/collective_plan.py): each
transformer layer is one, and unit 0 holds what several layers or the chunk's ends read.

zero>=2, gradients: when backward has produced every gradient of a unit for a microbatch
(a post-accumulate-grad hook per parameter counts them; the end of the B or W action
flushes the rest), the unit's gradients are reduce-scattered over dp_shard at once, added
into this rank's row shard of each gradient and dropped, so no full-size gradient outlives
its unit. `finish()` (the schedule's `wg`) waits for the last ones, all-reduces the shards
over dp_replicate (HSDP) and divides by the number of data-parallel ranks.

zero=3, parameters: between uses a parameter's storage is freed (resized to 0: the tensor,
and every view autograd saved of it, stay valid objects). Unit 0 is gathered by the schedule
(`ag c.0`) before the chunk's first forward and freed (`fr c.0`) after its last backward.
Layer units follow the chunk's UnitProgram: generated forward code calls `self.unit(k)`
before layer k's first op, which waits for layer k's gather, frees layer k-1 and issues the
gather of layer k+1 (prefetch). In backward, the forward saved (references to) parameters
through saved-tensor hooks; the first unpack of a layer's parameter gathers it again and
prefetches the layer before it; the layer is freed once its gradients are reduced. The
all-gathers run on one process group and the reduce-scatters on another, each issued in the
order autograd reaches the units, which is the same on every rank of a stage (same graph).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from threefold.runtime import comm, mixed_precision
from threefold.runtime.zero import RowShard, all_gather_flat, reduce_scatter_flat, row_peer_groups, split_rows

MAX_PENDING = 2      # reduce-scatters in flight before the oldest is waited for


class _Unit:
    """One unit of one local chunk: its parameters' row shards and its state."""
    __slots__ = ("chunk", "index", "name", "shards", "span", "gathered", "pending", "seen", "uses")

    def __init__(self, chunk: int, index: int, name: str, shards: list[RowShard]):
        self.chunk, self.index, self.name, self.shards = chunk, index, name, shards
        self.span = sum(s.per * s.width for s in shards)     # one rank's part of the flat buffer
        self.gathered = False
        self.pending = None      # (work, buffer) of an all-gather in flight
        self.seen: set[str] = set()   # parameters whose gradient arrived this microbatch
        self.uses = 0            # holders keeping it gathered (a chunk window, a forward, a backward)


class ShardedParams:
    """The engine's zero>=2 state: row shards of gradients (and of parameters under zero=3)."""

    def __init__(self, engine, cplan):
        mesh, coord, groups = engine.mesh, engine.coord, engine.groups
        self.zero = cplan.zero
        # dtype=bf16|fp16: parameters travel in 16 bits (the forward casts them so anyway) and
        # land in the fp32 storage; gradients are reduced in fp32
        self.wire = mixed_precision.compute_dtype(engine.manifest)
        self.gathered_bytes = 0         # parameters whole right now (zero=3) ...
        self.peak_gathered_bytes = 0    # ... and the most at once since the last reset
        self.d = mesh.size("dp_shard")
        self.replicas = mesh.size("dp_replicate")
        self.scale = 1.0 / mesh.size(cplan.batch_axes)
        self.group = groups.of("dp_shard")          # all-gathers
        self.rs_group = groups.of("dp_shard#rs")    # reduce-scatters, in their own order
        # after the reduce-scatter a shard is summed over the ranks holding the same rows with
        # other data (replicas, cp ranks, and ep ranks for dense rows: zero.DENSE_ROW_PEERS)
        self.dense_peers, self.expert_peers = row_peer_groups(engine)
        self.experts = engine.manifest.expert_weights()   # placed ep S(0), or whole on their ep rank
        trainable = dict(engine.named_parameters())
        own = self.zero >= 3   # the shard keeps its own storage: the parameter's is freed
        self.rows: dict[str, RowShard] = {f: split_rows(f, p, self.d, coord.dp_shard, own=own)
                                          for f, p in trainable.items()}
        self.grads: dict[str, torch.Tensor] = {}   # FQN -> this rank's rows of the gradient
        self.units: dict[int, list[_Unit]] = {}
        for c in engine.modules:
            self.units[c] = [_Unit(c, u.index, u.name, [self.rows[f] for f in u.fqns if f in self.rows])
                             for u in cplan.units.get(c, ())]
        self.active: int | None = None       # the chunk whose backward (or W) is running
        self.phase = "forward"
        self._in_flight: list = []           # (work, recv, unit) reduce-scatters not yet added
        self._storage: dict[int, list[_Unit]] = {}   # parameter storage -> the units holding it
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready(f))
                       for f, p in trainable.items()]
        if own:
            for units in self.units.values():
                for u in units:
                    for s in u.shards:
                        self._storage.setdefault(_key(s.param), []).append(u)
            for s in self.rows.values():
                _free(s.param)

    # -- parameters (zero=3) --------------------------------------------------------------
    def _start_gather(self, u: _Unit) -> None:
        if self.zero < 3 or u.gathered or u.pending is not None or not u.shards:
            return
        dtype = self.wire or u.shards[0].param.dtype
        mine = torch.zeros(u.span, dtype=dtype, device=u.shards[0].shard.device)
        off = 0
        for s in u.shards:
            mine[off:off + s.count * s.width].copy_(s.shard.detach().reshape(-1))
            off += s.per * s.width
        if self.group is None:   # one dp_shard rank (HSDP with dp_shard = ep): the shard is whole
            u.pending = (None, mine.view(1, u.span))
            return
        every = torch.empty(self.d, u.span, dtype=dtype, device=mine.device)
        work = all_gather_flat(every.view(-1), mine, self.group, f"parameters of {u.name}", async_op=True)
        u.pending = (work, every)

    def _finish_gather(self, u: _Unit) -> None:
        if self.zero < 3 or u.gathered or not u.shards:
            return
        if u.pending is None:
            self._start_gather(u)
        work, every = u.pending
        if work is not None:
            comm.wait(work, f"the all-gather of {u.name}'s parameters", self.group)
        off = 0
        with torch.no_grad():
            for s in u.shards:
                n = s.per * s.width
                rows = every[:, off:off + n].reshape(self.d * s.per, s.width)[:s.rows]
                if _alloc(s.param):
                    self.gathered_bytes += s.param.numel() * s.param.element_size()
                s.rows_of(s.param.data).copy_(rows)
                off += n
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        u.pending, u.gathered = None, True

    def _free_unit(self, u: _Unit) -> None:
        if self.zero < 3 or not u.gathered or u.uses > 0:
            return
        for s in u.shards:
            if not any(v.gathered and v is not u and v.uses > 0 for v in self._storage.get(_key(s.param), ())):
                if _free(s.param):
                    self.gathered_bytes -= s.param.numel() * s.param.element_size()
        u.gathered = False

    def hold(self, chunk: int, index: int) -> None:
        """Gather a unit and keep it until `release` (the schedule's ag c.0 / fr c.0)."""
        u = self.units[chunk][index] if index < len(self.units.get(chunk, ())) else None
        if u is None:
            return
        self._finish_gather(u)
        u.uses += 1

    def release(self, chunk: int, index: int) -> None:
        u = self.units[chunk][index] if index < len(self.units.get(chunk, ())) else None
        if u is None:
            return
        u.uses = max(0, u.uses - 1)
        self._free_unit(u)

    def enter(self, chunk: int, k: int) -> None:
        """Generated forward (and a recomputed layer in backward) is about to run layer k."""
        units = self.units.get(chunk)
        if not units or k >= len(units):
            return
        u = units[k]
        self._finish_gather(u)
        if self.phase == "forward":
            if k > 1:
                self._free_unit(units[k - 1])
            if k + 1 < len(units):
                self._start_gather(units[k + 1])
        elif k > 1:
            self._start_gather(units[k - 1])

    def ensure_whole(self, param: torch.Tensor) -> None:
        """Gather the unit holding `param` if it is freed (a read outside saved tensors)."""
        for u in self._storage.get(_key(param), ()):
            if not u.gathered:
                self.enter(u.chunk, u.index)
            return

    def end_forward(self, chunk: int) -> None:
        for u in self.units.get(chunk, ())[1:]:
            self._free_unit(u)

    @contextlib.contextmanager
    def saving(self, chunk: int):
        """zero=3: a chunk's forward saves references to parameters for backward, whose
        unpack gathers their unit again (and prefetches the layer before it)."""
        if self.zero < 3 or not self.units.get(chunk):
            yield
            return
        units = {}
        for u in self.units[chunk]:
            for s in u.shards:
                units[_key(s.param)] = u

        def pack(t):
            try:   # (meta tensors too: a dry run's backward gathers again as a real one does)
                unit = units.get(t.untyped_storage()._cdata) if t.requires_grad else None
            except (RuntimeError, NotImplementedError):   # a tensor without a storage of its own
                unit = None
            return (unit, t)

        def unpack(packed):
            u, t = packed
            if u is not None and not u.gathered:
                self.enter(u.chunk, u.index)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    # -- gradients (zero>=2) --------------------------------------------------------------
    def _grad_ready(self, fqn: str):
        def hook(p):
            c = self.active
            for u in self.units.get(c, ()):
                if fqn in {s.fqn for s in u.shards}:
                    u.seen.add(fqn)
                    if len(u.seen) == len(u.shards):
                        self._reduce_unit(u)
                    return
        return hook

    def _reduce_unit(self, u: _Unit) -> None:
        """Reduce-scatter a unit's gradients for this microbatch; drop the full ones."""
        shards = [s for s in u.shards if s.param.grad is not None]
        u.seen = set()
        if not shards:
            self._done_with(u)
            return
        if self.rs_group is None:   # one dp_shard rank: the rows are the whole gradient
            for s in shards:
                self._add(s, s.rows_of(s.param.grad).reshape(-1))
                s.param.grad = None
            self._done_with(u)
            return
        span = sum(s.per * s.width for s in shards)
        send = torch.zeros(self.d, span, dtype=torch.float32, device=shards[0].param.device)
        off = 0
        for s in shards:
            g = s.rows_of(s.param.grad)
            for r in range(self.d):
                rows = g[r * s.per:(r + 1) * s.per]
                send[r, off:off + rows.numel()].view_as(rows).copy_(rows)
            off += s.per * s.width
            s.param.grad = None   # the full gradient is not kept past its reduction
        recv = torch.empty(span, dtype=torch.float32, device=send.device)
        work = reduce_scatter_flat(recv, send.view(-1), self.rs_group, f"gradients of {u.name}")
        self._in_flight.append((work, recv, shards))
        while len(self._in_flight) > MAX_PENDING:
            self._land(*self._in_flight.pop(0))
        self._done_with(u)

    def _done_with(self, u: _Unit) -> None:
        if u.index > 0 and self.phase != "forward":
            self._free_unit(u)

    def _land(self, work, recv: torch.Tensor, shards: list[RowShard]) -> None:
        comm.wait(work, "a gradient reduce-scatter", self.rs_group)
        off = 0
        for s in shards:
            self._add(s, recv[off:off + s.count * s.width])
            off += s.per * s.width

    def _add(self, s: RowShard, rows: torch.Tensor) -> None:
        mine = rows.view(s.count, *s.param.shape[1:]) if s.param.dim() else rows.view(s.count)
        acc = self.grads.get(s.fqn)
        if acc is None:
            self.grads[s.fqn] = mine.clone()
        else:
            acc.add_(mine)

    def begin_backward(self, chunk: int) -> None:
        self.active, self.phase = chunk, "backward"
        for u in self.units.get(chunk, ()):
            u.seen = set()

    def end_backward(self, chunk: int, weights_done: bool) -> None:
        """After a B (weights_done: its gradients are complete) or a W action: reduce what the
        hooks did not, and free the layers."""
        units = self.units.get(chunk, ())
        if weights_done:
            for u in reversed(units):
                if any(s.param.grad is not None for s in u.shards):
                    self._reduce_unit(u)
        for u in units[1:]:
            self._free_unit(u)
        self.active, self.phase = None, "forward"

    def finish(self) -> None:
        """The schedule's `wg`: every reduction landed, summed over replicas, averaged."""
        while self._in_flight:
            self._land(*self._in_flight.pop(0))
        grads = [(s.fqn, self.grads[s.fqn]) for s in self.rows.values() if self.grads.get(s.fqn) is not None]
        for peers, expert in ((self.dense_peers, False), (self.expert_peers, True)):
            mine = [g for fqn, g in grads if (fqn in self.experts) == expert]
            if peers is not None and mine:   # one flat all-reduce, not one per parameter
                flat = torch.cat([g.reshape(-1) for g in mine])
                comm.all_reduce(flat, peers, "gradient shards over the ranks holding the same rows")
                torch._foreach_copy_(mine, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in mine]), mine)])
        if grads:
            torch._foreach_mul_([g for _, g in grads], self.scale)

    def end_step(self) -> None:
        """After every step: a gather prefetched for a layer that was not used again (a
        zero-bubble B that needs none of its weights) is waited for and dropped, since the
        optimizer will change the shards it copied; layers still whole are freed."""
        for units in self.units.values():
            for u in units:
                if u.pending is not None:
                    if u.pending[0] is not None:
                        comm.wait(u.pending[0], f"the all-gather of {u.name}'s parameters", self.group)
                    u.pending = None
                if u.index > 0:
                    self._free_unit(u)

    def zero_grad(self) -> None:
        self.grads.clear()

    def grad_rows(self, fqn: str) -> torch.Tensor | None:
        """This rank's rows of a parameter's reduced gradient (None before any backward)."""
        return self.grads.get(fqn)


def _key(p: torch.Tensor) -> int:
    return p.untyped_storage()._cdata


def _free(p: torch.Tensor) -> bool:
    """Drop a parameter's storage (the tensor stays); True if it held any."""
    st = p.untyped_storage()
    if st.nbytes():
        st.resize_(0)
        return True
    return False


def _alloc(p: torch.Tensor) -> bool:
    """Give a freed parameter its storage back; True if it had none."""
    st = p.untyped_storage()
    need = (p.storage_offset() + p.numel()) * p.element_size()
    if st.nbytes() < need:
        st.resize_(need)
        return True
    return False
