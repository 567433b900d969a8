"""Run one rank's share of a training iteration: its chunks, on its schedule's action list.

The engine holds this rank's chunk modules (`ChunkModule`s, from generated code), the
artifact manifest that describes their boundaries, the verified schedule and the process
groups. `step(batch)` slices the global batch for this dp rank into microbatches, executes
the action list in order (compute, and point-to-point transfers posted in the verified
order), all-reduces gradients over dp in buckets as soon as each chunk's last backward is
done, sums tied-parameter gradients across the stages that share them, and returns the mean
loss over the global batch on every rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from threefold.runtime import comm, mixed_precision, optimizers
from threefold.runtime.boundary import Boundary
from threefold.runtime.comm import Groups
from threefold.runtime.receives import ReceivePlan, receive_plan
from threefold.runtime.manifest import Manifest
from threefold.runtime.module import ChunkModule
from threefold.runtime.schedule import Kind, Schedule
from threefold.runtime.ties import tied_param_stages
from threefold.runtime import weight_grad   # zero bubble: W runs what B deferred

BUCKET_BYTES = 25 * 2**20  # gradient all-reduce bucket size (Megatron/DDP-like)


@dataclass
class StepStats:
    seconds: float = 0.0
    peak_inflight: int = 0          # (chunk, microbatch) activations held at once
    loss: float = float("nan")


@dataclass
class _StepState:
    """Everything one call of step() tracks while it walks the action list."""
    micro: list[tuple]                                   # this dp rank's microbatches
    m: int
    train: bool
    slots: dict = field(default_factory=dict)           # (chunk, mb) -> _Slot
    sends: list = field(default_factory=list)           # comm.PendingSend not yet complete
    posted: dict = field(default_factory=dict)          # receive position -> comm.PendingRecv
    loss_posted: tuple | None = None                    # (this rank's share, its all-reduce)
    reductions: list = field(default_factory=list)      # (work, flat, grads) dp all-reduces
    losses: list = field(default_factory=list)
    denominator: float = 1.0                            # the global loss denominator D
    outputs: list = field(default_factory=list)         # forward-only outputs (no loss)
    model_outputs: bool = False                         # pm(x) with a loss: the model's outputs
    inflight: int = 0
    peak: int = 0
    split: bool = False                                 # zero bubble: B and W run apart
    deferred: dict = field(default_factory=dict)        # (chunk, mb) -> what W needs (weight_grad)


@dataclass
class _Slot:
    """What one (chunk, microbatch) keeps between its forward and its backward."""
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    output_grads: list[torch.Tensor] = field(default_factory=list)


class PipelineEngine:
    def __init__(self, manifest: Manifest, modules: dict[int, ChunkModule], schedule: Schedule,
                 groups: Groups, device: torch.device):
        self.manifest = manifest
        self.modules = modules
        self.schedule = schedule
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
        self.batch_dims = manifest.batch_dims
        self._step_count = 0
        self._rng_base = _shared_seed()
        for mod in modules.values():
            mod.tp_group = groups.tp
        # plan dtype / zero (runtime/mixed_precision.py, runtime/zero.py, runtime/optimizers.py)
        mixed_precision.install_autocast(modules, mixed_precision.compute_dtype(manifest), device)
        self.wire_dtype = mixed_precision.wire_dtype(manifest)   # boundary tensors on the wire
        self.loss_scale = 1.0           # fp16: the loss scaler's, set by pm.optimizer's wrapper
        self.dp_grad_hook = None        # zero=1: ZeroGradSync replaces the dp all-reduce
        self.plan_optimizer = None      # the optimizer pm.optimizer(...) built
        self._optimizer_needed = optimizers.requirement(manifest)
        self._casts = mixed_precision.CastCache(mixed_precision.compute_dtype(manifest))
        self._share_local_ties()
        self._plan_grad_sync()
        self.stats = StepStats()
        self._boundaries: dict = {}
        self._plan_cache: tuple | None = None   # (schedule, its ReceivePlan, loss position)

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

    def _plan_grad_sync(self) -> None:
        actions = self.schedule.actions[self.stage]
        last_bwd: dict[int, int] = {}
        # a chunk's gradients are complete after its last W (zero bubble) or else its last B
        grads_done = Kind.WEIGHT if self.schedule.splits_backward else Kind.BACKWARD
        for i, a in enumerate(actions):
            if a.kind is grads_done:
                last_bwd[a.chunk] = i
        # Each parameter is reduced with the local chunk whose backward finishes last.
        owner: dict[str, int] = {}
        for c in sorted(self.modules, key=lambda c: last_bwd.get(c, -1)):
            for fqn in self.modules[c].PARAMS:
                owner[fqn] = c
        self._reduce_after: dict[int, list[str]] = {}   # action index -> FQNs to reduce
        for fqn, c in owner.items():
            if c in last_bwd:
                self._reduce_after.setdefault(last_bwd[c], []).append(fqn)
        # Tied parameters shared across stages: stage sets from the manifest.
        local = [self.chunk_meta[c] for c in sorted(self.modules)]
        self._tied: list[tuple[str, tuple[int, ...]]] = sorted(tied_param_stages(local, self.mesh.pp, self.schedule.layout).items())

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

    # -- one iteration ---------------------------------------------------------------------
    def step(self, batch: tuple, train: bool = True, schedule: Schedule | None = None,
             model_outputs: bool = False) -> float:
        """Run all microbatches of the global `batch` (model inputs..., target); mean loss.
        `model_outputs` (forward only, no target in `batch`): the last chunk computes the
        model's outputs instead of the loss (its `model_outputs` method), kept in last_outputs."""
        start = time.perf_counter()
        schedule = schedule or self.schedule
        st = _StepState(micro=self._microbatches(batch, schedule.m), m=schedule.m, train=train, model_outputs=model_outputs,
                        split=train and schedule.splits_backward)
        for mod in self.modules.values():
            mod.train(train)  # generated code reads self.training (dropout, batch norm)
        if train and self._optimizer_needed and self.plan_optimizer is None:
            from threefold.errors import PlanError
            raise PlanError(self._optimizer_needed)
        with_loss = self.has_loss and not model_outputs
        st.denominator = self._global_denominator(st) if with_loss else 1.0
        self._step_count += 1
        self._casts.hold()   # bf16/fp16: one weight copy per step, not per microbatch
        handlers = {Kind.FORWARD: self._forward, Kind.SEND_ACT: self._send_act,
                    Kind.BACKWARD: self._backward_action, Kind.SEND_GRAD: self._send_grad,
                    Kind.WEIGHT: self._weight_action}
        actions = schedule.actions[self.stage]
        rx, loss_after = self._step_plan(schedule)
        if not with_loss:   # pm(x) with a loss: no loss to all-reduce
            loss_after = None
        if loss_after is not None and loss_after < 0:
            self._post_loss(st)
        for i, a in enumerate(actions):
            # receives are posted ahead and land just before the compute that reads them
            for j in rx.post_before.get(i, ()):
                st.posted[j] = self._post_recv(st, actions[j])
            for j in rx.land_before.get(i, ()):
                self._land(st, actions[j], st.posted.pop(j))
            if not a.is_recv:
                handlers[a.kind](st, a)
            if i == loss_after:
                self._post_loss(st)
            if i in self._reduce_after:   # the last B (or W) of a chunk
                st.reductions.extend(self._start_reduce(self._reduce_after[i]))
            if st.sends and a.is_compute:  # drop finished sends so their buffers can be freed
                st.sends = [s for s in st.sends if not s.done()]
        for j in rx.land_before.get(len(actions), ()):
            self._land(st, actions[j], st.posted.pop(j))
        for s in st.sends:
            s.wait()
        if train:
            if self.dp_grad_hook is not None:
                self.dp_grad_hook.finish(st.reductions)
            else:
                for work, flat, grads in st.reductions:
                    comm.wait(work, "data-parallel gradient all-reduce")
                    _unflatten_into(flat, grads, scale=1.0 / self.mesh.dp)
            self._sum_tied()
            self._sync_tp_grads()
        loss = self._global_loss(st.losses, st.denominator, st.loss_posted) if with_loss else float("nan")
        self.stats = StepStats(time.perf_counter() - start, st.peak, loss)
        self.last_outputs = st.outputs
        self._casts.release()
        return loss

    # One method per action kind; each reads and updates the step's state.
    def _step_plan(self, schedule: Schedule) -> tuple[ReceivePlan, int]:
        """This rank's receive plan for `schedule`, and the position after which its share of
        the loss is known (-1: before the first action; None: no loss all-reduce)."""
        if self._plan_cache is None or self._plan_cache[0] is not schedule:
            actions = schedule.actions[self.stage]
            last = self.num_chunks - 1
            loss_after = None
            if self.has_loss and self.mesh.pp > 1:
                loss_after = max((i for i, a in enumerate(actions)
                                  if a.kind is Kind.FORWARD and a.chunk == last), default=-1)
            self._plan_cache = (schedule, receive_plan(actions), loss_after)
        return self._plan_cache[1], self._plan_cache[2]

    def _post_recv(self, st: "_StepState", a) -> comm.PendingRecv:
        if a.kind is Kind.RECV_ACT:
            b, what = self._boundary(a.chunk, "inputs"), f"activations of chunk {a.chunk - 1} microbatch {a.mb}"
        else:
            b, what = self._boundary(a.chunk, "outputs", grads=True), f"gradients of chunk {a.chunk} microbatch {a.mb}"
        return comm.post_recv(b.recv_specs(), self._peer(a.peer), what, self.device)

    def _land(self, st: "_StepState", a, pending: comm.PendingRecv) -> None:
        if a.kind is Kind.RECV_ACT:
            self._recv_act(st, a, pending.wait())
        else:
            self._recv_grad(st, a, pending.wait())

    def _recv_act(self, st: "_StepState", a, received: list[torch.Tensor]) -> None:
        tensors = self._boundary(a.chunk, "inputs").unpack(received)
        for t in tensors:
            if st.train and t.is_floating_point():
                t.requires_grad_(True)
        st.slots[(a.chunk, a.mb)] = _Slot(inputs=tensors)

    def _forward(self, st: "_StepState", a) -> None:
        key = (a.chunk, a.mb)
        slot = st.slots.setdefault(key, _Slot(inputs=[]))
        mod = self.modules[a.chunk]
        is_last = a.chunk == self.num_chunks - 1
        # pm(x) with a loss: the last chunk's model_outputs method (codegen/model_outputs.py)
        fn, reads = ((mod.model_outputs, mod.MODEL_OUTPUT_INPUTS) if is_last and st.model_outputs
                     else (mod, mod.USER_INPUTS))
        user = [st.micro[a.mb][j] for j in reads]
        # random ops seed from (step, global microbatch): independent across dp ranks too
        mod.rng_key = (self._rng_base, self._step_count, self.coord.dp * st.m + a.mb)
        # zero bubble: the module's deferred ops keep what W needs here (runtime/weight_grad.py)
        mod.weight_stash = st.deferred.setdefault(key, []) if st.split else None
        with torch.set_grad_enabled(st.train):
            outs = list(fn(*slot.inputs, *user))
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
            st.slots[(a.chunk + 1, a.mb)] = _Slot(inputs=_handed_over(outs, st.train))
        if not st.train:
            slot.inputs = []
            if is_last or local_next:
                st.slots.pop(key)
                st.inflight -= 1

    def _send_act(self, st: "_StepState", a) -> None:
        slot = st.slots[(a.chunk, a.mb)]
        st.sends.append(comm.send(self._boundary(a.chunk, "outputs").pack(slot.outputs), self._peer(a.peer),
                                  f"activations of chunk {a.chunk} microbatch {a.mb}"))
        if not st.train:
            st.slots.pop((a.chunk, a.mb))
            st.inflight -= 1
        else:
            _release_outputs(slot.outputs, self.chunk_meta[a.chunk].releasable)

    def _recv_grad(self, st: "_StepState", a, received: list[torch.Tensor]) -> None:
        slot = st.slots[(a.chunk, a.mb)]
        slot.output_grads = self._boundary(a.chunk, "outputs", grads=True).unpack(received)

    def _backward_action(self, st: "_StepState", a) -> None:
        slot = st.slots[(a.chunk, a.mb)]
        self._backward(slot, a.chunk == self.num_chunks - 1, st.denominator)
        st.inflight -= 1
        if a.chunk == 0 or not slot.inputs:  # nothing to send back
            st.slots.pop((a.chunk, a.mb))
        elif a.chunk - 1 in self.modules:   # ZB-V's turn: the previous chunk is on this rank
            st.slots.pop((a.chunk, a.mb))
            st.slots[(a.chunk - 1, a.mb)].output_grads = _input_grads(slot)

    def _weight_action(self, st: "_StepState", a) -> None:
        """W (zero bubble): the weight gradients chunk a.chunk's B deferred for microbatch a.mb."""
        weight_grad.run_deferred(st.deferred.pop((a.chunk, a.mb), []))

    def _send_grad(self, st: "_StepState", a) -> None:
        slot = st.slots.pop((a.chunk, a.mb))
        grads = [g if g is not None else torch.zeros_like(x)
                 for x, g in zip(slot.inputs, slot.input_grads) if x.is_floating_point()]
        st.sends.append(comm.send(self._boundary(a.chunk, "inputs", grads=True).pack(grads), self._peer(a.peer),
                                  f"gradients of chunk {a.chunk - 1} microbatch {a.mb}"))

    def _backward(self, slot: _Slot, is_last: bool, denominator: float) -> None:
        if is_last and self.has_loss:
            # d(global loss)/d(numerator) = 1/D; times dp because the dp all-reduce averages
            seed = self.mesh.dp / denominator * self.loss_scale   # loss_scale: fp16 only
            tensors, grads = [slot.outputs[0]], [torch.full_like(slot.outputs[0], seed)]
        else:
            pairs = [(o, g) for o, g in zip([o for o in slot.outputs if o.is_floating_point()],
                                            slot.output_grads) if o.requires_grad]
            tensors, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if tensors:
            # The engine call skips autograd's shape check, so outputs whose storage was
            # released after sending (see _release_outputs) still backpropagate.
            torch.autograd.Variable._execution_engine.run_backward(
                tuple(tensors), tuple(grads), False, False, (), True, True)
        slot.input_grads = [x.grad if x.requires_grad else None for x in slot.inputs]
        slot.outputs, slot.output_grads = [], []

    def _microbatches(self, batch: tuple, m: int) -> list[tuple]:
        dp, d = self.mesh.dp, self.coord.dp
        out = [[] for _ in range(m)]
        dims = self.batch_dims
        for i, t in enumerate(batch):
            # the batch dim found by the compiler (manifest); old artifacts: dim 0
            bd = dims[i] if dims is not None and i < len(dims) else (0 if dims is None else None)
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
        return self.mesh.moved(self.groups.rank, pp=stage)

    # -- gradient synchronisation ----------------------------------------------------------
    def _start_reduce(self, fqns: list[str]) -> list:
        """Start async dp all-reduces of these gradients, in buckets of <= BUCKET_BYTES."""
        if self.dp_grad_hook is not None:   # zero=1: reduce-scatter (runtime/zero.py)
            return self.dp_grad_hook.start(fqns)
        grads = [self.params[f].grad for f in fqns if self.params[f].grad is not None]
        if self.groups.dp is None or not grads:
            return []
        buckets, current, size = [], [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if current and size + nbytes > BUCKET_BYTES:
                buckets.append(current)
                current, size = [], 0
            current.append(g)
            size += nbytes
        buckets.append(current)
        started = []
        for bucket in buckets:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            started.append((comm.all_reduce(flat, self.groups.dp, "gradients", async_op=True), flat, bucket))
        return started

    def _sum_tied(self) -> None:
        for fqn, stages in self._tied:
            p = self.params[fqn]
            if not p.requires_grad:  # frozen: no gradient to sum
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, self.groups.ties[stages], f"tied gradient {fqn}")

    def _sync_tp_grads(self) -> None:
        """Parameters applied to sequence shards: each tp rank has part of the gradient."""
        for fqn in self.manifest.tp_grad_sync:
            p = self.params.get(fqn)
            if p is not None and p.grad is not None and self.groups.tp is not None:
                comm.all_reduce(p.grad, self.groups.tp, f"sequence-parallel gradient {fqn}")

    def _global_denominator(self, st: "_StepState") -> float:
        """D: the loss's denominator over the global batch (see the manifest's "loss"),
        known before the first backward so every microbatch's backward is seeded with 1/D.

        A per-microbatch constant c gives c*m*dp; a sum-reduced loss gives 1; a graph (the
        number of targets != ignore_index) is evaluated on every microbatch by the last
        chunk's module and summed over dp (only the last stage needs it)."""
        den = self.loss_form
        if den.denominator == "one":
            return 1.0
        if den.denominator == "const":
            return float(den.value) * st.m * self.mesh.dp
        last = self.modules.get(self.num_chunks - 1)
        if last is None:
            return float("nan")  # not the last stage: never seeds a loss backward
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for mb in st.micro:
                total += last.loss_denominator(*[mb[j] for j in last.DENOMINATOR_INPUTS])[0].double()
        if self.mesh.dp > 1:
            comm.all_reduce(total, self.groups.dp, "the loss denominator")
        return float(total)

    def _post_loss(self, st: "_StepState") -> None:
        """pp > 1: start the loss all-reduce as soon as this rank's share is known (the
        stages without the last chunk at once, the last stage after its last forward), so
        no rank waits for it at the end of the step."""
        total = self._loss_share(st.losses, st.denominator)
        st.loss_posted = (total, comm.all_reduce(total, None, "the loss", async_op=True))

    def _loss_share(self, losses: list[torch.Tensor], denominator: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.double()
        if losses:
            total /= denominator
        return total

    def _global_loss(self, losses: list[torch.Tensor], denominator: float, posted=None) -> float:
        """The loss over the global batch (sum of numerators / D), the same on every rank.

        The last stage's ranks hold the microbatch numerators (every tp rank the same ones)
        and divide by D. Without pipelining a dp all-reduce suffices; with it, one
        all-reduce over the world brings the loss to the other stages too.
        """
        if posted is not None:
            total, work = posted
            comm.wait(work, "the loss all-reduce", None)
            return float(total) / self.mesh.tp
        total = self._loss_share(losses, denominator)
        if self.mesh.pp > 1:
            comm.all_reduce(total, None, "the loss")
            return float(total) / self.mesh.tp
        if self.mesh.dp > 1:
            comm.all_reduce(total, self.groups.dp, "the loss")
        return float(total)


def _shared_seed() -> int:
    """The base seed of random ops: rank 0's torch.initial_seed(), the same on every rank."""
    import torch.distributed as dist
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            seed = seed.cuda()
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _unflatten_into(flat: torch.Tensor, grads: list[torch.Tensor], scale: float) -> None:
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g)).mul_(scale)
        offset += n


def _handed_over(outs: list[torch.Tensor], train: bool) -> list[torch.Tensor]:
    """A chunk's outputs as the next chunk's inputs on the same rank, as a receive gives
    them: autograd leaves, so each chunk's backward stops at its own inputs."""
    inputs = [o.detach() for o in outs]
    for t in inputs:
        if train and t.is_floating_point():
            t.requires_grad_(True)
    return inputs


def _input_grads(slot: "_Slot") -> list[torch.Tensor]:
    """The gradients of a chunk's floating inputs (zeros where autograd gave none)."""
    return [g if g is not None else torch.zeros_like(x)
            for x, g in zip(slot.inputs, slot.input_grads) if x.is_floating_point()]


def _release_outputs(outputs: list[torch.Tensor], releasable: list[bool]) -> None:
    """Free the storage of sent outputs that backward does not read (Megatron does the same).

    Only outputs no op of the chunk reads (the manifest's `releasable`), that are not views,
    and whose grad_fn did not save the result itself (softmax, tanh, ...) are freed.
    """
    for o, ok in zip(outputs, releasable):
        fn = o.grad_fn
        if not ok or fn is None or o._base is not None or hasattr(fn, "_saved_result"):
            continue
        o.data = torch.empty((0,), dtype=o.dtype, device=o.device)
