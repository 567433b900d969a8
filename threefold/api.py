"""`threefold.parallelize`: an unmodified model in, this rank's share of it out.

Every rank calls it (after the default process group exists, e.g. under torchrun or
`threefold.launch`). Each rank traces and compiles the whole model (deterministic, so all
ranks agree), generates the sources, loads only its own chunks and the weight shards cut
from the model's own weights, and wraps them in a `ParallelModule`.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import math
import os
import warnings
import weakref
from datetime import timedelta
import gc

import torch
import torch.distributed as dist

from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.runtime.assemble import assemble_rank, check_world, current_rank_and_world, default_device
from threefold.runtime.comm import default_timeout
from threefold.runtime.loader import import_source
from threefold.runtime.optimizers import make_optimizer
from threefold.runtime.output_tree import rebuild
from threefold.runtime.shard import rank_shard
from threefold.workload import Workload, load_spec


def _write_trace(out: str, trace: dict) -> None:
    from threefold.report.trace_page import write_trace   # lazy: only a traced run draws pages
    write_trace(out, trace)


class ParallelModule:
    """This rank's chunks of a parallelized model, with a training step."""

    def __init__(self, engine, plan: Plan, manifest, program=None, model=None, loss_fn=None):
        self.engine = engine
        self.plan = plan
        self.manifest = manifest
        self.program = program
        from threefold.runtime.trace import EnvTrace   # lazy: start-up: runtime.trace loads only on this path
        self._env_trace = EnvTrace.from_env(engine, _write_trace)   # THREEFOLD_TRACE=DIR (runtime/trace.py)
        # the user's model (weakly: never kept alive for this) and loss_fn, to name the op
        # behind a non-finite first loss (threefold/nonfinite.py)
        self._model = weakref.ref(model) if model is not None else (lambda: None)
        self._loss_fn = loss_fn
        self._first_step_checked = False

    def _batch(self, inputs: tuple, target, what: str) -> tuple:
        """The engine's batch: the model's inputs, then the target where a loss_fn takes one."""
        m = self.manifest
        if not m.has_loss:
            # lazy: start-up: model_loss loads only on this path
            from threefold.model_loss import no_loss_message
            raise PlanError(f"{what}: {no_loss_message(m.model or 'the model')}")
        if m.takes_target and target is None:
            raise PlanError(f"{what} needs target=...: the model was compiled with a loss_fn")
        if not m.takes_target and target is not None:
            raise PlanError(f"{what} got target=..., but the model computes its own loss (no loss_fn was "
                            "given): pass labels as a model input, or parallelize with loss_fn=")
        return tuple(inputs) + ((target,) if m.takes_target else ())

    def step(self, *inputs, target=None) -> float:
        """One iteration over the global batch: all microbatches forward and backward,
        gradients synchronised. Returns the mean loss, identical on every rank."""
        batch = self._batch(inputs, target, "pm.step")
        if self._env_trace is not None:
            loss = self._env_trace.run(lambda: self.engine.step(batch, train=True))
        else:
            loss = self.engine.step(batch, train=True)
        if not self._first_step_checked:
            self._first_step_checked = True
            if not math.isfinite(loss):   # the same value on every rank: all raise alike
                self._raise_nonfinite(loss, inputs, target)
        return loss

    def _raise_nonfinite(self, loss: float, inputs: tuple, target) -> None:
        # lazy: start-up: nonfinite loads only on this path
        from threefold.nonfinite import first_nonfinite_op, nonfinite_message
        model = self._model()
        found = "" if model is None else first_nonfinite_op(model, tuple(inputs), target, self._loss_fn)
        raise PlanError(nonfinite_message(loss, self.manifest.model or "the model", found))

    def evaluate(self, *inputs, target=None) -> float:
        """Forward only (no gradients): the mean loss over the global batch."""
        batch = self._batch(inputs, target, "pm.evaluate")
        with torch.no_grad():
            return self.engine.step(batch, train=False, schedule=self.engine.forward_schedule())

    def forward(self, *inputs):
        """Forward-only inference: the model's outputs on the last stage, in the structure
        the eager model returns (a tensor, a tuple, a dict, a ModelOutput ...; the
        microbatches concatenated along the batch; this dp rank's share of it), None on
        other stages.
        For a model compiled with a loss the last chunk's `model_outputs` method computes
        them, gathering tensor-parallel shards (vocab-parallel logits) there only."""
        with_loss = self.manifest.has_loss
        if self.manifest.plan.cp > 1:   # each rank holds 2 of 2*cp sequence blocks, not whole outputs
            raise PlanError(f"pm(x) under cp={self.manifest.plan.cp} is not supported yet (each rank holds only "
                            "its blocks of every sequence); train with pm.step, or read outputs with cp=1")
        if with_loss and self.manifest.model_outputs_missing:   # every rank refuses alike
            raise PlanError(f"pm(x) cannot return the model's outputs: {self.manifest.model_outputs_missing}")
        # a loss the model returns itself is per microbatch in the outputs (a numerator once
        # the batch is split): the exact global value comes from a forward-only step, which
        # every rank runs alike
        plan = self.manifest.plan
        whole_loss = self.evaluate(*inputs) if with_loss and not self.manifest.takes_target \
            and plan.dp * plan.microbatches > 1 else None
        with torch.no_grad():
            self.engine.step(tuple(inputs), train=False, schedule=self.engine.forward_schedule(),
                             model_outputs=with_loss)
        outs = self.engine.last_outputs
        if not outs:
            return None
        dims = self.manifest.output_batch_dims or []   # the compiler's; old artifacts: 0
        scalars = [i for i, t in enumerate(outs[0]) if t.dim() == 0]
        if len(outs) > 1 and scalars and (whole_loss is None or len(scalars) > 1):
            raise PlanError(f"pm(x): the model returns {len(scalars)} scalars, which cannot be combined over "
                            f"{plan.dp * plan.microbatches} microbatch/dp parts; use m=1 and dp=1 for pm(x)")
        tensors = tuple(parts[0] if i in scalars and len(outs) == 1 and whole_loss is None
                        else torch.tensor(whole_loss, dtype=parts[0].dtype) if i in scalars
                        else torch.cat(parts, dim=dims[i] if i < len(dims) else 0)
                        for i, parts in enumerate(zip(*outs)))
        return rebuild(self.manifest.output_tree, tensors)   # as the eager model returned them

    __call__ = forward

    def parameters(self):
        return self.engine.parameters()

    def named_parameters(self):
        return self.engine.named_parameters()

    def optimizer(self, optimizer_cls, params=None, *args, **kwargs):
        """The optimizer this plan needs around `optimizer_cls` (runtime/optimizers.py):
        the plain torch optimizer over pm.parameters() (zero=0), its ZeRO-1 sharded form
        (zero=1), loss-scaled under dtype=fp16. `params`: pm.parameters() or groups of them."""
        return make_optimizer(self.engine, optimizer_cls, params, *args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float = math.inf) -> float:
        """Clip this step's gradients by their global norm over every rank (each shard,
        replicated and tied parameter counted once, as one process would); returns the
        norm before clipping, the same on every rank. Every rank must call it."""
        # lazy: start-up: runtime.grad_norm loads only on this path
        from threefold.runtime.grad_norm import clip_grad_norm_
        return clip_grad_norm_(self.engine, max_norm)

    def state_dict(self) -> dict:
        """This rank's parameters (frozen included) and buffers by original FQN, each a
        `threefold.Sharded`: `.shape` the full tensor's, `.local` this rank's shard,
        `.placement` Replicate() or Shard(dim) over the tp ranks, `.parts` where the shard
        sits in the full tensor. See threefold.save for files."""
        # lazy: start-up: checkpoint.state loads only on this path
        from threefold.checkpoint.state import model_state
        return model_state(self)

    def load_state_dict(self, full: dict) -> None:
        """Copy in full (unsharded) tensors by original FQN, each rank cutting its shard;
        every parameter and buffer must be given (a PlanError names the first few missing)."""
        # lazy: start-up: checkpoint.state loads only on this path
        from threefold.checkpoint.state import load_full_state
        load_full_state(self, full)

    @property
    def stats(self):
        return self.engine.stats


def parallelize(model=None, plan=None, example_inputs=None, loss_fn=None, *, target=None,
                device=None, workdir: str | None = None, batch_dims=None, weights: str | None = None,
                dry_run: bool = False, world: int | None = None):
    """Compile `model` for `plan` and return this rank's `ParallelModule`.

    `weights=PATH` (a .safetensors file or a Hugging Face directory): each rank reads only
    its own slices from it (checkpoint/weights.py), so `model` may be on the meta device.

    `dry_run=True, world=N`: start nothing and train nothing; in this one process, dry-run
    the whole job of N ranks (dp is filled in from N) on torch's fake process group with
    meta tensors: every rank's program runs one training step without data, what the ranks
    issue is cross-checked (every group's collectives agree in order and shape, every send
    has its receive, no two ranks enter shared groups in opposite orders) and each rank's
    memory at its step peak is compared with the memory model. Returns a
    `threefold.dry_run.DryRunReport`: `.ok`, `.mismatches`, `.memory(rank)` (bytes by
    category: params, grads, optimizer, activations, buffers, total), `.collectives(rank)`,
    `.summary` (what `threefold check SPEC --plan P --dry-run --world N --json` prints) and
    `str(report)` (its text). The model may be on the meta device. Above 64 ranks one class
    per pipeline stage stands for its ranks (runtime/dry_check.py says why that suffices).

    As a decorator on a model class or factory, `@parallelize(plan=..., example_inputs=...,
    loss_fn=..., target=...)`, calling the decorated thing builds the model and returns the
    ParallelModule.
    """
    if model is None or not isinstance(model, torch.nn.Module):
        factory = model
        def decorate(fn):
            @functools.wraps(fn)
            def build(*args, **kwargs):
                return parallelize(fn(*args, **kwargs), plan, example_inputs, loss_fn,
                                   target=target, device=device, workdir=workdir,
                                   batch_dims=batch_dims, weights=weights, dry_run=dry_run, world=world)
            return build
        return decorate(factory) if callable(factory) else decorate

    if example_inputs is None:
        raise PlanError("parallelize needs example_inputs: a global batch of the model's inputs")
    if target is not None and loss_fn is None:
        raise PlanError("parallelize got target=... but no loss_fn: pass loss_fn=(lambda out, target: ...) "
                        "too, or leave target out when forward returns the loss itself")
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if dry_run:
        # lazy: start-up: the dry run loads only when asked for
        from threefold.dry_run import dry_run_workload
        return dry_run_workload(Workload(model, example_inputs, target, loss_fn, batch_dims=batch_dims), plan, world)
    if world is not None:
        raise PlanError(f"parallelize got world={world} without dry_run=True: a real job's world is its launcher's "
                        "(torchrun, threefold launch); pass dry_run=True to dry-run a job of that many ranks")
    _join_torchrun_job()
    plan = _resolve(plan, example_inputs, batch_dims)
    mesh = plan.mesh
    rank = check_world(mesh, str(plan))
    if weights is None and any(p.is_meta for p in model.parameters()):
        raise PlanError(f"{type(model).__name__} is on the meta device: it can be compiled "
                        "(threefold compile) but training needs real weights; build it on a device "
                        "or pass weights=PATH (safetensors)")
    # lazy: start-up: checkpoint.weights loads only on this path
    from threefold.checkpoint.weights import WeightSource, traceable
    with traceable(model):   # meta parameters: shapes suffice to compile
        prog, payload = _compile_once(rank, Workload(model, example_inputs, target, loss_fn,
                                                        batch_dims=batch_dims), plan,
                                      isolate=weights is not None)
    sources, manifest = payload["sources"], payload["manifest"]
    if prog is not None:   # rank 0: what the plan falls back to, once (threefold/fallbacks.py)
        from threefold.fallbacks import show_fallbacks   # lazy: start-up: fallbacks loads only on this path
        show_fallbacks(prog, f"threefold inspect SPEC --plan '{plan}', or pm.program.notes")
    # The sources are imported from memory (no temporary files to leave behind); with a
    # workdir they are also written there, for reading and debugging.
    root = workdir or f"<threefold-rank{rank}-{id(payload):x}>"
    if workdir:
        os.makedirs(root, exist_ok=True)
        for name, text in sources.items():
            with open(os.path.join(root, name), "w") as f:
                f.write(text)
    if "kernels.py" in sources:
        import_source(sources["kernels.py"], _join(root, "kernels.py"))
    dev = torch.device(device) if device is not None else default_device()
    full = _full_state(model, payload["constants"])
    # one source of initial weights: rank 0's, broadcast where fingerprints differ
    # lazy: start-up: checkpoint.agree loads only on this path
    from threefold.checkpoint.agree import same_as_rank0
    source = WeightSource(weights, model, manifest.ties) if weights is not None else None
    full.update(same_as_rank0({k: v for k, v in full.items() if not k.startswith("_const.") and not v.is_meta
                               and not (source and source.key_of(k))}, dev)[0])
    if loss_fn is not None:   # a loss the last chunk runs eagerly calls it by name
        # lazy: start-up: runtime.eager_loss loads only on this path
        from threefold.runtime.eager_loss import register
        register(loss_fn)
    engine = assemble_rank(manifest, _CompiledSource(sources, root, full, source, manifest.shards), rank, dev)
    return ParallelModule(engine, plan, manifest, prog, model=model, loss_fn=loss_fn)


class _CompiledSource:
    """Where `assemble_rank` gets this rank's modules and weights in `parallelize`: the
    sources rank 0 generated (in memory), and each parameter's shard cut from the model's
    own full tensors, or read slice by slice from a weights file (checkpoint/weights.py)."""

    def __init__(self, sources: dict[str, str], root: str, full: dict, weights, shards: dict):
        self.sources, self.root, self.full, self.weights, self.shards = sources, root, full, weights, shards

    def chunk_class(self, entry):
        return getattr(import_source(self.sources[entry.module], _join(self.root, entry.module)), entry.cls)

    def load_weights(self, module, entry, tp_rank: int, device) -> None:
        state = {}
        for fqn in list(module.PARAMS) + list(module.BUFFERS):
            t, spec = self.full[fqn], self.shards.get(fqn)
            if self.weights is not None and not fqn.startswith("_const."):   # this rank's slices only
                state[fqn] = self.weights.fill(module.p(fqn).detach(), fqn, spec, tp_rank, t)
            else:
                state[fqn] = rank_shard(t, spec, tp_rank).to(device)
        module.load_state(state)


def compile(workload, plan=None, progress=None, own_loss: bool = False):
    """`threefold.compile`: a workload (a `Workload`, its dict, or a SPEC string, loaded here
    by the front end) and a plan -> the compiler's final stage."""
    from threefold.compiler.api import compile_workload   # lazy: the compiler's imports (torch.export) only when compiling
    if isinstance(workload, str):
        workload = load_spec(workload)
    return compile_workload(workload, plan, progress=progress, own_loss=own_loss)


def _resolve(plan, example_inputs: tuple, batch_dims) -> Plan:
    """The plan with what its text leaves out filled in (threefold/plan_defaults.py): dp from
    the job's world size, m from the batch; a note (rank 0) when m had to be lowered."""
    # lazy: start-up: plan_defaults loads only on this path
    from threefold.plan_defaults import batch_rows, resolve_plan
    rank, world = current_rank_and_world()
    resolved = resolve_plan(plan, world=world, batch=batch_rows(example_inputs, batch_dims))
    if rank == 0:
        for note in resolved.notes:
            warnings.warn(f"threefold: plan {resolved.plan}: {note}", stacklevel=3)
    return resolved.plan


def _join(root: str, name: str) -> str:
    return f"{root}/{name}" if root.startswith("<") else os.path.join(root, name)


def _join_torchrun_job() -> None:
    """Under torchrun (its env set, no process group yet), initialise the default group
    from the environment (gloo on CPU, NCCL on GPU), as a user would expect."""
    if dist.is_available() and not dist.is_initialized() and all(
            k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # lazy: start-up: runtime.launch loads only on this path
        from threefold.runtime.launch import init_from_env
        init_from_env()
        # The group is ours, so we close it: left to interpreter teardown, gloo's threads were
        # sometimes destroyed while joinable (SIGABRT at exit, seen under load).
        atexit.register(_leave_job)


def _leave_job() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _compile_once(rank: int, workload: Workload, plan: Plan, isolate: bool = False):
    """Rank 0 compiles; the sources and manifest reach the other ranks by broadcast.

    Tracing is deterministic, so every rank could compile for itself; doing it once saves
    (world - 1) compiles, which on a shared machine is most of the start-up time. With
    `isolate` (weights read from files: the model may be large) rank 0 compiles in a forked
    child, so torch.export's ~190 MB of code never stays in a rank (threefold/isolated.py).
    """
    # lazy: start-up: isolated loads only on this path
    from threefold.isolated import fork_available, run_in_child
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    prog, payload = None, None
    if rank == 0:
        # lazy: start-up: compile_cache loads only on this path
        from threefold.compile_cache import take, workload_key
        handed = take(workload_key(workload.model, workload.inputs, workload.target, workload.loss_fn, plan,
                                   workload.batch_dims)) if os.environ.get("THREEFOLD_COMPILED") else None
    if rank == 0 and handed is not None:   # the command's parent compiled this very workload
        payload = handed
    elif rank == 0:
        try:
            if isolate and fork_available():
                stage_bytes, payload = run_in_child(_compile_payload, workload, plan, True,
                                                    what="compiling on rank 0")
                # lazy: start-up: ir.stage_io loads only on this path
                from threefold.ir.stage_io import stage_from_bytes
                prog = stage_from_bytes(stage_bytes)
            else:
                prog, payload = _compile_payload(workload, plan)
        except PlanError as exc:
            payload = {"error": str(exc), "plan_error": True}
        except Exception as exc:
            payload = {"error": f"compiling on rank 0 failed: {type(exc).__name__}: {exc}", "plan_error": False}
            if world > 1:
                _wait_for_rank0_compile(rank)
                dist.broadcast_object_list([payload], src=0)
            raise
        _return_freed_memory()
    if world > 1:
        _wait_for_rank0_compile(rank)
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    if "error" in payload:
        raise (PlanError if payload["plan_error"] else RuntimeError)(payload["error"])
    return prog, payload


def compile_timeout() -> timedelta:
    """How long the other ranks wait for rank 0's compile: THREEFOLD_COMPILE_TIMEOUT seconds,
    default ten times the collective timeout (at least 600 s). Compiling is minutes of work
    that grows with the model and the machine's load, not a collective that should finish in
    THREEFOLD_TIMEOUT; under a loaded 2-core host a 4-layer LLaMA's compile took over 60 s."""
    base = default_timeout()
    text = os.environ.get("THREEFOLD_COMPILE_TIMEOUT")
    if text is None:
        return max(10 * base, timedelta(seconds=600))
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 1e6:
        raise PlanError(f"THREEFOLD_COMPILE_TIMEOUT={text!r} is invalid: give seconds above 0 and "
                        "at most 1000000, e.g. 600")
    return timedelta(seconds=seconds)


_compiles_started = itertools.count()   # per process; every rank calls parallelize alike


def _wait_for_rank0_compile(rank: int) -> None:
    """Every rank meets here once rank 0 has compiled (or failed to), waiting on a store key
    bounded by compile_timeout(), so the broadcast that follows never waits on the compile
    under the collective timeout. (A gloo barrier would: its sends are bounded by it.)"""
    key = f"threefold/compiled/{next(_compiles_started)}"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(key, "1")
    else:
        try:
            store.wait([key], compile_timeout())
        except RuntimeError as exc:
            if "timeout" not in str(exc).lower():
                raise
            raise RuntimeError(f"rank 0 did not finish compiling within {compile_timeout().total_seconds():.0f} s "
                               "(THREEFOLD_COMPILE_TIMEOUT)") from None


def _compile_payload(workload: Workload, plan: Plan, as_bytes: bool = False):
    """(program, what every rank needs from it: sources, manifest, lifted constants); the
    program as stage bytes (shapes, no weights) when it must leave a child process."""
    # imported here: only the compiling rank (or its child) pays for the compiler's imports
    # lazy: start-up: codegen.artifact loads only on this path
    from threefold.codegen.artifact import build_manifest, build_sources
    # lazy: start-up: compiler.api loads only on this path
    from threefold.compiler.api import compile_workload
    from threefold.ir.stage_io import stage_to_bytes   # lazy: start-up: ir.stage_io loads only on this path
    prog = compile_workload(workload, plan, own_loss=True)   # no loss_fn: the model's own loss trains
    sources = build_sources(prog)
    return stage_to_bytes(prog) if as_bytes else prog, {"sources": sources,
                  "manifest": build_manifest(prog, sources, {}, with_weights=False),
                  "constants": {k: v for k, v in prog.state.items() if k.startswith("_const.")}}


def _return_freed_memory() -> None:
    """Give the tracer's garbage back to the OS before the weights are read, so the compiling
    rank's peak is not its compile plus its shard (glibc keeps freed heap otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim
        pass


def _full_state(model: torch.nn.Module, constants: dict) -> dict:
    """Full tensors by canonical FQN (tied parameters under their first name)."""
    state = {name: p.detach() for name, p in model.named_parameters()}
    state.update({name: b.detach() for name, b in model.named_buffers()})
    state.update(constants)
    return state
