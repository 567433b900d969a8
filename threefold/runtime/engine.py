"""Run one rank's share of a training iteration: its chunks, on its schedule's action list.

The engine holds this rank's chunk modules (`ChunkModule`s, from generated code), the
artifact manifest that describes their boundaries, the verified schedule and the process
groups. `step(batch)` slices the global batch for this dp rank into microbatches and
executes the action list in order: compute, point-to-point transfers posted in the verified
order, and the step's collectives (runtime/collective_plan.py: the loss denominator and the
loss, gradient reductions per bucket, ZeRO-3 gathers and frees, tied and sequence-parallel
sums), each one a handler below (the gradient collectives' in runtime/grad_reduce.py). It
returns the mean loss over the global batch on every rank.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import torch

from threefold.errors import PlanError
from threefold.runtime import comm, compiled, dispatch, mixed_precision, optimizers
from threefold.runtime.boundary import Boundary
from threefold.runtime.buffer_pool import BufferPool
from threefold.runtime.collective_plan import CollectivePlan, with_collectives
from threefold.runtime.comm import Groups
from threefold.runtime.receives import ReceivePlan, receive_plan
from threefold.runtime.manifest import Manifest
from threefold.runtime.grad_reduce import GradReduce
from threefold.runtime.mesh import BATCH_AXES, chunk_layout
from threefold.runtime.module import ChunkModule
from threefold.runtime.random_ops import shared_seed
from threefold.runtime.run_plan import InputSplit, cutting_axes, input_cut
from threefold.runtime.schedule import Kind, Schedule, forward_only
from threefold.runtime.slot import Slot, handed_over, input_grads, release_outputs
from threefold.runtime import weight_grad   # zero bubble: W runs what B deferred


@dataclass
class StepStats:
    seconds: float = 0.0
    peak_inflight: int = 0          # (chunk, microbatch) activations held at once
    loss: float = float("nan")


@dataclass
class _StepState:
    """Everything one call of step() tracks while it walks the action list."""
    micro: list[tuple]                                   # this dp rank's microbatches
    batch: tuple                                         # the global batch they were cut from
    m: int
    train: bool
    slots: dict = field(default_factory=dict)           # (chunk, mb) -> Slot
    sends: list = field(default_factory=list)           # comm.PendingSend not yet complete
    posted: dict = field(default_factory=dict)          # receive position -> comm.PendingRecv
    loss_posted: tuple | None = None                    # (this rank's share, its all-reduce)
    loss_deferred: bool = False                         # the share rides on the gradient exchange
    local: object = None                                # runtime/local_reduce.LocalExchange, this step's
    links: object = None                                # runtime/local_p2p.Links: pipeline messages via /dev/shm
    reductions: list = field(default_factory=list)      # (work, flat, grads) dp all-reduces
    gathered: set = field(default_factory=set)          # zero=3: chunks whose unit 0 this step holds
    losses: list = field(default_factory=list)
    denominator: float = 1.0                            # the global loss denominator D
    outputs: list = field(default_factory=list)         # forward-only outputs (no loss)
    model_outputs: bool = False                         # pm(x) with a loss: the model's outputs
    with_loss: bool = False                             # this step computes the loss
    inflight: int = 0
    peak: int = 0
    split: bool = False                                 # zero bubble: B and W run apart
    deferred: dict = field(default_factory=dict)        # (chunk, mb) -> what W needs (weight_grad)
    messages: dict = field(default_factory=dict)        # id(send or receive action) -> dispatch.Message


class PipelineEngine:
    def __init__(self, manifest: Manifest, modules: dict[int, ChunkModule], schedule: Schedule,
                 groups: Groups, device: torch.device, collectives: CollectivePlan):
        self.manifest = manifest
        self.modules = modules
        self.schedule = schedule          # with its collectives (runtime/collective_plan.py)
        self.collectives = collectives
        self.groups = groups
        self.mesh = groups.mesh
        self.coord = self.mesh.coord(groups.rank)
        self.stage = self.coord.pp
        self.device = device
        self.num_chunks = manifest.num_chunks
        self.chunk_meta = manifest.chunks
        self.has_loss = manifest.has_loss
        # how partial losses combine (compiler's passes/loss_form.py)
        self.loss_form = manifest.loss
        self.input_splits = manifest.input_splits   # how a step cuts each input (its placement)
        self._step_count = 0
        self._rng_base = shared_seed()
        for mod in modules.values():
            mod.tp_group = groups.tp
            mod.ep_group = groups.of("ep")
            mod.cp_group = groups.of("cp")
        # plan compile=inductor (runtime/compiled.py): inside autocast's wrapper, so the
        # compiled code sees the autocast state as a guard
        compiled.install(modules, manifest.plan.compile)
        if manifest.plan.compile != "none":   # peers wait longer while a step compiles
            self.step = compiled.with_compile_grace(self.step, groups)
        # plan dtype / zero (runtime/mixed_precision.py, runtime/zero.py, runtime/optimizers.py)
        mixed_precision.install_autocast(modules, mixed_precision.compute_dtype(manifest), device)
        self.wire_dtype = mixed_precision.wire_dtype(manifest)   # boundary tensors on the wire
        self.loss_scale = 1.0           # fp16: the loss scaler's, set by pm.optimizer's wrapper
        self.dp_grad_hook = None        # zero=1: ZeroGradSync replaces the dp all-reduce
        self.plan_optimizer = None      # the optimizer pm.optimizer(...) built
        self._optimizer_needed = optimizers.requirement(manifest)
        self._casts = mixed_precision.CastCache(mixed_precision.compute_dtype(manifest))
        self._share_local_ties()
        self.batch_ranks = self.mesh.size(BATCH_AXES)   # ranks that split the batch (gradients average over them)
        self.batch_group = groups.of(BATCH_AXES)
        self.sharded = None             # zero>=2: gradient (and zero=3 parameter) shards
        if collectives.zero >= 2:
            # lazy: start-up: runtime.fsdp loads only on this path
            from threefold.runtime.fsdp import ShardedParams
            self.sharded = ShardedParams(self, collectives)
            for c, mod in modules.items():
                mod.shard_units = (self.sharded, c)
        self._casts.enabled = self._casts.enabled and collectives.zero < 3   # no whole-model copy
        self._forward_schedule = None
        self.stats = StepStats()
        self._boundaries: dict = {}
        self._peers: dict[int, int] = {}   # pp stage -> the rank this rank exchanges with there
        # this rank's index among the ranks that split the batch (random ops' microbatch key)
        self._batch_rank = 0   # mixed radix over dp and the axes that cut inputs (cp), dp outermost
        for a in ("dp",) + cutting_axes():
            self._batch_rank = self._batch_rank * self.mesh.size(a) + self.coord[a]
        self._plan_cache: tuple | None = None   # (schedule, its ReceivePlan, loss position)
        self._programs: dict = {}       # id(schedule) -> its runtime/dispatch.Program
        self.recv_pool = BufferPool()   # receive buffers, reused once their last reader is gone
        self.tracer = None      # a runtime/trace.Recorder while a step is traced (else no clock reads)
        self.grads = GradReduce(self)   # the step's gradient collectives (runtime/grad_reduce.py)
        self._links: tuple | None = None   # (local_p2p.Links or None,) once set up (runtime/local_p2p.py)
        self.memo: dict = {}            # caches of pure functions of this engine's fixed parts (grad_norm.py)

    # -- what other parts register: the only way they change the engine -------------------
    def use_grad_sync(self, sync) -> None:
        """zero=1 (runtime/zero.py): `sync.start(fqns)` / `sync.finish(reductions)` replace the
        dp all-reduce of gradients."""
        self.dp_grad_hook = sync

    def use_optimizer(self, opt) -> None:
        """The optimizer pm.optimizer(...) built (runtime/optimizers.py); a plan that needs one
        (zero, fp16) refuses a training step without it."""
        self.plan_optimizer = opt

    def set_loss_scale(self, scale: float) -> None:
        """fp16: the scale the next backward is seeded with (the loss scaler's, after each step
        and after a checkpoint restores it)."""
        self.loss_scale = float(scale)

    @contextlib.contextmanager
    def traced(self, recorder):
        """--trace (runtime/trace.py): every action of the steps run inside is timed by `recorder`."""
        self.tracer = recorder
        try:
            yield
        finally:
            self.tracer = None

    def counters(self) -> dict:
        """What a checkpoint keeps of the engine: its step count and the random ops' base seed."""
        return {"engine_step": self._step_count, "rng_base": self._rng_base}

    def restore_counters(self, engine_step: int | None = None, rng_base: int | None = None) -> None:
        """A checkpoint's counters (checkpoint/load.py); None keeps the current value."""
        if engine_step is not None:
            self._step_count = int(engine_step)
        if rng_base is not None:
            self._rng_base = int(rng_base)

    # -- set-up ----------------------------------------------------------------------------
    def _share_local_ties(self) -> None:
        """Chunks on this rank that hold the same (tied) parameter use one Parameter object."""
        first: dict[str, torch.nn.Parameter] = {}
        for c in sorted(self.modules):
            mod = self.modules[c]
            for fqn in mod.PARAMS:
                if fqn in first:
                    owner = mod._owner(fqn)
                    setattr(owner, fqn.rsplit(".", 1)[-1], first[fqn])
                    mod._state_cache = None
                else:
                    first[fqn] = mod.p(fqn)
        self.params: dict[str, torch.nn.Parameter] = first

    def parameters(self):
        """Trainable parameters only: frozen ones (requires_grad=False) get no optimizer state."""
        return [p for p in self.params.values() if p.requires_grad]

    def named_parameters(self):
        return [(k, p) for k, p in self.params.items() if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if self.sharded is not None:
            self.sharded.zero_grad()

    def forward_schedule(self) -> Schedule:
        """Forward only (evaluate, pm(x)): every chunk's forwards, with their collectives."""
        if self._forward_schedule is None:
            plan = self.manifest.plan
            base = forward_only(self.mesh.pp, plan.microbatches, plan.interleave, chunk_layout(plan.schedule))
            self._forward_schedule = with_collectives(base, self.collectives, train=False)
        return self._forward_schedule

    # -- one iteration ---------------------------------------------------------------------
    def step(self, batch: tuple, train: bool = True, schedule: Schedule | None = None,
             model_outputs: bool = False) -> float:
        """Run all microbatches of the global `batch` (model inputs..., target); mean loss.
        `model_outputs` (forward only, no target in `batch`): the last chunk computes the
        model's outputs instead of the loss (its `model_outputs` method), kept in last_outputs."""
        start = time.perf_counter()
        schedule = schedule or self.schedule
        st = _StepState(micro=self._microbatches(batch, schedule.m), batch=batch, m=schedule.m, train=train, model_outputs=model_outputs,
                        split=train and schedule.splits_backward)
        for mod in self.modules.values():
            if mod.training != train:   # (train() walks every submodule: only on a change)
                mod.train(train)  # generated code reads self.training (dropout, batch norm)
        if train and self._optimizer_needed and self.plan_optimizer is None:
            raise PlanError(self._optimizer_needed)
        with_loss = self.has_loss and not model_outputs
        st.with_loss = with_loss
        st.local = self.grads.local_exchange() if train else None
        st.links = self._p2p_links()
        self._step_count += 1
        self._casts.hold()   # bf16/fp16: one weight copy per step, not per microbatch
        handlers = {Kind.FORWARD: self._forward, Kind.SEND_ACT: self._send_act,
                    Kind.BACKWARD: self._backward_action, Kind.SEND_GRAD: self._send_grad,
                    Kind.WEIGHT: self._weight_action,
                    Kind.LOSS_DENOMINATOR: self._denominator_action, Kind.LOSS: self._loss_action,
                    Kind.ALL_REDUCE_GRADS: self.grads.reduce, Kind.REDUCE_SCATTER_GRADS: self.grads.reduce,
                    Kind.WAIT_GRADS: self.grads.wait, Kind.TIED_SUM: self.grads.tied_sum, Kind.SP_SUM: self.grads.sp_sum,
                    Kind.UNSHARD: self._unshard, Kind.RESHARD: self._reshard}
        post, land = self._post_recv, self._land
        if self.tracer is not None:   # --trace: each action timed (runtime/trace.py)
            handlers, post, land = self.tracer.wrap(handlers, post, land)
        prog = dispatch.program(self, schedule, self._step_plan(schedule))
        st.messages = prog.messages
        posted, sends = st.posted, st.sends
        try:
            for posts, lands, kind, a, compute in prog.steps:
                # receives are posted ahead and land just before the compute that reads them
                for j, r in posts:
                    posted[j] = post(st, r)
                for j, r in lands:
                    land(st, r, posted.pop(j))
                if kind is not None:   # (a receive runs as its landing)
                    handlers[kind](st, a)
                if sends and compute:  # drop finished sends so their buffers can be freed
                    comm.drop_finished(sends)
            for j, r in prog.tail:
                land(st, r, posted.pop(j))
            for s in sends:
                s.wait()
            loss = self._global_loss(st) if with_loss else float("nan")
        finally:
            for c in list(st.gathered):   # a step that raised: do not keep whole parameters
                self.sharded.release(c, 0)
            if self.sharded is not None:
                self.sharded.end_step()
        self.stats = StepStats(time.perf_counter() - start, st.peak, loss)
        self.last_outputs = st.outputs
        self._casts.release()
        return loss

    # One method per action kind; each reads and updates the step's state.
    def _step_plan(self, schedule: Schedule) -> ReceivePlan:
        """This rank's receive plan for `schedule` (cached per schedule)."""
        if self._plan_cache is None or self._plan_cache[0] is not schedule:
            self._plan_cache = (schedule, receive_plan(schedule.actions[self.stage]))
        return self._plan_cache[1]

    def _post_recv(self, st: "_StepState", a) -> comm.PendingRecv:
        m = st.messages[id(a)]
        return comm.post_recv(m.specs, m.peer, m.what, self.device, self.recv_pool, st.links)

    def _land(self, st: "_StepState", a, pending: comm.PendingRecv) -> None:
        if a.kind is Kind.RECV_ACT:
            self._recv_act(st, a, pending.wait())
        else:
            self._recv_grad(st, a, pending.wait())

    def _recv_act(self, st: "_StepState", a, received: list[torch.Tensor]) -> None:
        tensors = st.messages[id(a)].boundary.unpack(received)
        if st.train:
            for t in tensors:
                if t.is_floating_point():
                    t.requires_grad_(True)
        st.slots[(a.chunk, a.mb)] = Slot(inputs=tensors)

    def _forward(self, st: "_StepState", a) -> None:
        key = (a.chunk, a.mb)
        slot = st.slots.setdefault(key, Slot(inputs=[]))
        mod = self.modules[a.chunk]
        is_last = a.chunk == self.num_chunks - 1
        # pm(x) with a loss: the last chunk's model_outputs method (codegen/model_outputs.py)
        fn, reads = ((mod.model_outputs, mod.MODEL_OUTPUT_INPUTS) if is_last and st.model_outputs
                     else (mod, mod.USER_INPUTS))
        user = [st.micro[a.mb][j] for j in reads]
        # random ops seed from (step, global microbatch): independent across dp ranks too
        mod.rng_key = (self._rng_base, self._step_count, self._batch_rank * st.m + a.mb)
        mod.microbatch = a.mb   # buffers updated once per step restart from the step's value
        # zero bubble: the module's deferred ops keep what W needs here (runtime/weight_grad.py)
        mod.weight_stash = st.deferred.setdefault(key, []) if st.split else None
        with torch.set_grad_enabled(st.train), self._saving(a.chunk):
            outs = list(fn(*slot.inputs, *user))
        if self.sharded is not None:
            self.sharded.end_forward(a.chunk)
        st.inflight += 1
        st.peak = max(st.peak, st.inflight)
        if is_last:
            if self.has_loss and not st.model_outputs:
                st.losses.append(outs[0].detach())
            else:
                st.outputs.append([o.detach() for o in outs])
        slot.outputs = outs
        local_next = not is_last and a.chunk + 1 in self.modules   # ZB-V's turn: no message
        if local_next:
            st.slots[(a.chunk + 1, a.mb)] = Slot(inputs=handed_over(outs, st.train))
        if not st.train:
            slot.inputs = []
            if is_last or local_next:
                st.slots.pop(key)
                st.inflight -= 1

    def _send_act(self, st: "_StepState", a) -> None:
        slot = st.slots[(a.chunk, a.mb)]
        m = st.messages[id(a)]
        sent = comm.send(m.boundary.pack(slot.outputs), m.peer, m.what, st.links)
        if sent is not comm.SENT:   # (through shared memory: complete already, nothing to keep)
            st.sends.append(sent)
        if not st.train:
            st.slots.pop((a.chunk, a.mb))
            st.inflight -= 1
        elif self.manifest.plan.compile == "none":
            # (a compiled backward may save a forward output the eager one does not)
            release_outputs(slot.outputs, self.chunk_meta[a.chunk].releasable)

    def _recv_grad(self, st: "_StepState", a, received: list[torch.Tensor]) -> None:
        slot = st.slots[(a.chunk, a.mb)]
        slot.output_grads = st.messages[id(a)].boundary.unpack(received)

    def _saving(self, chunk: int):
        """zero=3: the forward saves parameter references whose unpack gathers them again."""
        if self.sharded is None:
            return contextlib.nullcontext()
        return self.sharded.saving(chunk)

    def _backward_action(self, st: "_StepState", a) -> None:
        slot = st.slots[(a.chunk, a.mb)]
        if self.sharded is not None:
            self.sharded.begin_backward(a.chunk)
        self._backward(slot, a.chunk == self.num_chunks - 1, st.denominator)
        if self.sharded is not None:
            self.sharded.end_backward(a.chunk, weights_done=not st.split)
        st.inflight -= 1
        if a.chunk == 0 or not slot.inputs:  # nothing to send back
            st.slots.pop((a.chunk, a.mb))
        elif a.chunk - 1 in self.modules:   # ZB-V's turn: the previous chunk is on this rank
            st.slots.pop((a.chunk, a.mb))
            st.slots[(a.chunk - 1, a.mb)].output_grads = input_grads(slot)

    def _weight_action(self, st: "_StepState", a) -> None:
        """W (zero bubble): the weight gradients chunk a.chunk's B deferred for microbatch a.mb."""
        if self.sharded is not None:
            self.sharded.begin_backward(a.chunk)
        weight_grad.run_deferred(st.deferred.pop((a.chunk, a.mb), []))
        if self.sharded is not None:
            self.sharded.end_backward(a.chunk, weights_done=True)

    def _send_grad(self, st: "_StepState", a) -> None:
        slot = st.slots.pop((a.chunk, a.mb))
        m = st.messages[id(a)]
        sent = comm.send(m.boundary.pack(input_grads(slot)), m.peer, m.what, st.links)
        if sent is not comm.SENT:
            st.sends.append(sent)

    def _backward(self, slot: Slot, is_last: bool, denominator: float) -> None:
        if is_last and self.has_loss:
            # d(global loss)/d(numerator) = 1/D; times the batch ranks because the gradient
            # reduction averages over them
            seed = self.batch_ranks / denominator * self.loss_scale   # loss_scale: fp16 only
            tensors, grads = [slot.outputs[0]], [torch.full_like(slot.outputs[0], seed)]
        else:
            pairs = [(o, g) for o, g in zip([o for o in slot.outputs if o.is_floating_point()],
                                            slot.output_grads) if o.requires_grad]
            tensors, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if tensors:
            # The engine call skips autograd's shape check, so outputs whose storage was
            # released after sending (runtime/slot.py) still backpropagate.
            try:
                torch.autograd.Variable._execution_engine.run_backward(
                    tuple(tensors), tuple(grads), False, False, (), True, True)
            except RuntimeError as exc:   # a compiled backward's collective: name it as comm would
                failure = comm.in_graph_failure(exc, "a chunk's backward")
                if failure is None:
                    raise
                raise failure from None
        slot.input_grads = [x.grad if x.requires_grad else None for x in slot.inputs]
        slot.outputs, slot.output_grads = [], []

    def _microbatches(self, batch: tuple, m: int, at: dict | None = None, whole: tuple = ()) -> list[tuple]:
        """The m microbatches of the batch-rank at coordinates `at` (axis -> index: dp and the
        axes that cut inputs; this rank's where not given) of the global `batch` (the
        denominator also cuts the other ranks' shares)."""
        at = at or {}
        dp, d = self.mesh.dp, at.get("dp", self.coord.dp)
        out = [[] for _ in range(m)]
        splits = self.input_splits
        for i, t in enumerate(batch):
            # the dims the compiler placed this input along (manifest): each cutting axis's
            # (cp: this rank's blocks r and 2cp-1-r of each sequence), then the batch rows
            split = splits[i] if i < len(splits) else InputSplit()
            if isinstance(t, torch.Tensor):
                for axis, dim in split.cuts:
                    if axis == "cp" and self.manifest.seq_length not in (None, t.shape[dim]):
                        raise ValueError(f"input {i} has {t.shape[dim]} positions (dim {dim}), but the artifact was "
                                         f"compiled for {self.manifest.seq_length} (cp's code is specialised to the "
                                         "length it pads to 2*cp blocks): recompile for this length")
                    if axis not in whole:   # `whole`: axes not cut (the loss denominator's whole sequences)
                        t = input_cut(axis)(t, dim, self.mesh.size(axis), at.get(axis, self.coord[axis]))
            bd = split.batch
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or bd is None:
                for mb in out:
                    mb.append(t.to(self.device) if isinstance(t, torch.Tensor) else t)
                continue
            n = t.shape[bd]
            if n % (dp * m):
                raise ValueError(f"batch size {n} (dim {bd}) is not divisible by dp*m={dp * m}")
            local = t.to(self.device).chunk(dp, dim=bd)[d]
            for mb, piece in zip(out, local.chunk(m, dim=bd)):
                mb.append(piece)
        return [tuple(mb) for mb in out]

    def _boundary(self, chunk: int, side: str, grads: bool = False) -> Boundary:
        key = (chunk, side, grads)
        if key not in self._boundaries:
            self._boundaries[key] = Boundary(getattr(self.chunk_meta[chunk], side), self.groups.tp,
                                             self.manifest.scatter_gather, grads, wire=self.wire_dtype)
        return self._boundaries[key]

    def _peer(self, stage: int) -> int:
        # cached: the mesh arithmetic costs more than a dict lookup, once per message
        peer = self._peers.get(stage)
        if peer is None:
            peer = self._peers[stage] = self.mesh.moved(self.groups.rank, pp=stage)
        return peer

    # -- collectives (the schedule's; runtime/collective_plan.py) ---------------------------
    def _denominator_action(self, st: "_StepState", a) -> None:
        if st.with_loss:
            st.denominator = self._global_denominator(st)

    def _loss_action(self, st: "_StepState", a) -> None:
        """Post the loss all-reduce as soon as this rank's share is known (the stages without
        the last chunk at once, the last stage after its last forward); waited at the end."""
        if not st.with_loss:
            return
        total = self._loss_share(st.losses, st.denominator)
        if st.local is not None:   # summed by the gradient exchange's barrier (grad_reduce.py)
            st.loss_posted, st.loss_deferred = (total, None), True
            return
        group = None if self.mesh.pp > 1 else self.batch_group
        work = comm.all_reduce(total, group, "the loss", async_op=True) if (
            self.mesh.pp > 1 or self.batch_group is not None) else None
        st.loss_posted = (total, work)

    def _p2p_links(self):
        """The pipeline channels through shared memory (runtime/local_p2p.py), or None: CPU
        pipelines only. Set up once, by every rank at its first step, sized from the plan's
        schedule: per directed pair of ranks, the bytes of each message of a step."""
        if self.mesh.pp == 1 or self.device.type != "cpu":
            return None
        if self._links is None:
            # lazy: start-up: runtime.local_p2p loads only on this path
            from threefold.runtime import local_p2p
            self._links = (local_p2p.open_links(dispatch.p2p_messages(self)),)
        return self._links[0]

    def _unshard(self, st: "_StepState", a) -> None:
        self.sharded.hold(a.chunk, a.mb)
        st.gathered.add(a.chunk)

    def _reshard(self, st: "_StepState", a) -> None:
        self.sharded.release(a.chunk, a.mb)
        st.gathered.discard(a.chunk)

    def _global_denominator(self, st: "_StepState") -> float:
        """D: the loss's denominator over the global batch (see the manifest's "loss"),
        known before the first backward so every microbatch's backward is seeded with 1/D.

        A per-microbatch constant c gives c*m*(batch ranks); a sum-reduced loss gives 1; a
        graph (the number of targets != ignore_index) is evaluated by the last chunk's module
        on every microbatch of every batch rank: each rank holds the global batch, so it cuts
        the other ranks' shares itself and sums them, with no collective. (An all-reduce here
        was the step's first synchronisation: every rank waited at it for the slowest one
        before its first forward.)"""
        den = self.loss_form
        if den.denominator == "one":
            return 1.0
        if den.denominator == "const":
            return float(den.value) * st.m * self.batch_ranks
        last = self.modules.get(self.num_chunks - 1)
        if last is None:
            return float("nan")  # not the last stage: never seeds a loss backward
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        # axes along which it reads whole inputs (cp: labels shifted inside the model; passes/cp_denominator.py)
        whole = tuple(den.detail.get("whole_along", ()))
        with torch.no_grad():
            axes = ("dp",) + tuple(a for a in cutting_axes() if a not in whole)   # every batch rank: dp x the axes that cut inputs
            for index in itertools.product(*(range(self.mesh.size(a)) for a in axes)):
                at = dict(zip(axes, index))
                micro = st.micro if not whole and all(at[a] == self.coord[a] for a in axes) else (
                    self._microbatches(st.batch, st.m, at, whole))
                for mb in micro:
                    total += last.loss_denominator(*[mb[j] for j in last.DENOMINATOR_INPUTS])[0].double()
        return float(total)

    def _loss_share(self, losses: list[torch.Tensor], denominator: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.double()
        if losses:
            total /= denominator
        return total

    def _global_loss(self, st: "_StepState") -> float:
        """The loss over the global batch (sum of numerators / D), the same on every rank.

        The last stage's ranks hold the microbatch numerators (every tp rank the same ones)
        and divide by D. Without pipelining a reduction over the batch ranks suffices; with
        it, one all-reduce over the world (the schedule's `ls`) brings the loss to the other
        stages too, counting each tp rank's copy."""
        total, work = st.loss_posted if st.loss_posted is not None else (
            self._loss_share(st.losses, st.denominator), None)
        if st.loss_deferred:   # a step whose gradients were not exchanged (none to reduce)
            comm.all_reduce(total, self.batch_group, "the loss")
            st.loss_deferred = False
        if work is not None:
            comm.wait(work, "the loss all-reduce", None)
        return float(total) / (self.mesh.tp if self.mesh.pp > 1 else 1)
