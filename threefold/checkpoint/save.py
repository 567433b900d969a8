"""`threefold.save(pm, optimizer, DIR, step=..., extra=..., keep=...)`: a sharded checkpoint.

Every rank calls it. The state (checkpoint/state.py) is written with
torch.distributed.checkpoint into a temporary directory under DIR: each rank writes its own
pieces, replicated pieces are written once (DCP's dedup). Each rank then checksums the
files it wrote, rank 0 writes `threefold.json` (files, plan, model, shapes) and renames the
directory to DIR/step_<N>, points DIR/latest at it and keeps the last `keep` checkpoints.

The write is `write_checkpoint`, which reads nothing of the live model: it takes the state
dict and the index's fields, so checkpoint/async_save.py can run it in a background thread
on a staged copy (over its own process group) while training goes on.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from threefold.checkpoint import files, state
from threefold.checkpoint.collective import from_rank0, gather_all, quiet as _quiet, rank_world
from threefold.checkpoint.groups import saved_groups
from threefold.errors import PlanError
from threefold.file_modes import as_if_created_plainly


def save(pm, optimizer, directory: str, step: int | None = None, extra=None, keep: int | None = 3,
         run: dict | None = None) -> str:
    """Write a checkpoint of `pm` (and `optimizer`, may be None) under `directory`; returns
    the checkpoint's path (directory/step_<N>), the same on every rank. `run` (threefold
    train's record: checkpoint/ownership.py) goes into the index; with it only this run's
    checkpoints are pruned or replaced."""
    from threefold.outdir import sigterm_raises   # lazy: start-up: outdir loads only on this path
    check_keep(keep)
    step = pm.engine.counters()["engine_step"] if step is None else int(step)
    sd = _collect(pm, optimizer, step, extra, rank_world()[0])
    with sigterm_raises("writing a checkpoint"):   # SIGTERM mid-save: the temporary is removed
        return write_checkpoint(sd, index_fields(pm, optimizer, step, run), directory, step, keep)


def check_keep(keep: int | None) -> None:
    if keep is not None and keep < 1:
        raise PlanError(f"keep={keep} is invalid: keep at least 1 checkpoint (or None for all)")


def index_fields(pm, optimizer, step: int, run: dict | None = None) -> dict:
    """What threefold.json says about the model, the plan and the run that wrote it (read from
    `pm` now, written later)."""
    return {"model": pm.manifest.get("model"), "plan": str(pm.plan), "step": step,
            "state_shapes": {k: v for k, v in pm.manifest["state_shapes"].items() if not k.startswith("_const.")},
            # buffers: constants of the model, not trained state; a plan that does not
            # read some (cp's ring drops a causal-mask buffer) loads without them
            "buffers": sorted(_buffer_names(pm.manifest)), "has_optimizer": optimizer is not None,
            **({"run": run} if run else {})}


def write_checkpoint(sd: dict, fields: dict, directory: str, step: int, keep: int | None, group=None) -> str:
    """Write `sd` as DIR/step_<N> (atomically: a temporary directory renamed when complete
    and verified); every rank calls it with its own `sd`. `group`: the process group of the
    collectives (None: the default one). Returns the checkpoint's path on every rank."""
    import torch.distributed.checkpoint as dcp   # lazy: DCP loads only when a checkpoint is saved or loaded
    rank, world = rank_world()
    name = files.step_name(step)
    tmp, held = None, None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            files.drop_partial(directory)     # what an interrupted save left (rank 0 alone saves here now)
            tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=directory)
            held = files.hold_partial(tmp)   # another run's drop_partial leaves it alone while we write
            as_if_created_plainly(tmp, directory=True)   # becomes step_<N>: the umask's mode
        except OSError as exc:
            tmp = PlanError(f"cannot write checkpoint directory {directory}: {exc.strerror or exc}")
    tmp = from_rank0(tmp, group)
    if isinstance(tmp, PlanError):
        raise tmp
    started = time.perf_counter()
    try:
        with _quiet(world):
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1, sync_files=True),
                     planner=_planner(), process_group=group, no_dist=world == 1)
        mine = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
        if rank == 0:
            mine.append(".metadata")
        written = {}
        for d in gather_all(files.digests(tmp, mine), group):
            written.update(d)
        outcome = None
        if rank == 0:
            try:
                # fields may name the world (staging.settle commits what another world staged)
                files.write_index(tmp, {"format": files.FORMAT, "version": 1, "world": world, **fields,
                                        "files": written, "seconds": time.perf_counter() - started})
                outcome = files.publish(directory, tmp, name, keep, (fields.get("run") or {}).get("id"))
            except OSError as exc:   # every rank raises it, none waits for a path that never comes
                outcome = exc
        outcome = from_rank0(outcome, group)
        if isinstance(outcome, BaseException):
            raise outcome
    except BaseException as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            _release(held)
        # lazy: start-up: outdir loads only on this path
        from threefold.outdir import disk_full, is_disk_full
        if is_disk_full(exc) or _any_disk_full(exc):    # DCP wraps each rank's OSError: name the cause
            raise PlanError(f"checkpoint {directory} at step {step} could not be written: {disk_full()}") from None
        raise
    _release(held)
    return outcome


def _release(fd) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _any_disk_full(exc: BaseException) -> bool:
    """torch's CheckpointException keeps each rank's exception in `failures`: {rank: (exc, trace)}."""
    from threefold.outdir import is_disk_full   # lazy: start-up: outdir loads only on this path
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return False
    return any(is_disk_full(v[0] if isinstance(v, tuple) else v) for v in failures.values())


def _planner():
    # lazy: start-up: checkpoint.planners loads only on this path
    from threefold.checkpoint.planners import SaveShards
    return SaveShards()


def _collect(pm, optimizer, step, extra, rank) -> dict:
    sd = {state.MODEL + k: v for k, v in state.model_state(pm).items()}
    if optimizer is not None:
        sd.update(state.optimizer_state(pm, optimizer))
        groups = saved_groups(pm, optimizer)   # with their parameters' FQNs, from every rank
        if rank == 0:
            sd[state.GROUPS] = groups
            if hasattr(optimizer, "scaler"):   # fp16: resume at the scale training had reached
                sd[state.SCALER] = optimizer.scaler.state_dict()
    if rank == 0:
        sd[state.META] = {"step": step, "extra": extra, **pm.engine.counters()}
    sd[f"rng.rank{rank}"] = state.rng_state()
    return sd


def _buffer_names(manifest: dict) -> set[str]:
    """The manifest's buffers: state that is not a parameter."""
    return {k for k in manifest.get("state_shapes", {}) if not k.startswith("_const.")} - set(
        manifest.get("local_shapes", {}))
