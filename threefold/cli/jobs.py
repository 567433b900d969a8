"""Run a function on every rank: under torchrun (env already set) or on local gloo ranks."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime.capacity import RANK_MEMORY_BYTES, max_local_ranks  # noqa: F401 (the CLI's names)
from threefold.runtime.capacity import available_memory as _available_memory  # noqa: F401
from threefold.runtime.capacity import check_local_capacity as check


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def job_world() -> int | None:
    """The number of ranks when a launcher fixed it (torchrun's WORLD_SIZE), else None (a
    local run starts as many ranks as the plan needs)."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


def command_plan(text, batch: int | None = None):
    """A command's plan with what its text leaves out filled in (threefold/plan_defaults.py:
    dp from the job's ranks, m from `batch` global rows): a ResolvedPlan, whose notes the
    command shows with `tell` once the plan has compiled."""
    # lazy: start-up: a command loads plan_defaults only when it runs
    from threefold.plan_defaults import resolve_plan
    return resolve_plan(text, world=job_world(), batch=batch)


def tell(resolved) -> None:
    """What the plan defaults chose for the user (m lowered to divide the batch), on stderr
    (once per job: the process that is or starts rank 0)."""
    if os.environ.get("RANK", "0") == "0":
        for note in resolved.notes:
            print(f"threefold: plan {resolved.plan}: {note}", file=sys.stderr)


def run_on_ranks(fn, world: int, *args, timeout: float | None = None) -> list:
    """Results of fn(*args) per rank (under torchrun: this rank's result only)."""
    if under_torchrun():
        # lazy: start-up: a command loads runtime.launch only when it runs
        from threefold.runtime.launch import init_from_env
        init_from_env()
        if dist.get_world_size() != world:
            raise PlanError(f"the plan needs {world} ranks but torchrun started "
                            f"{dist.get_world_size()}; use --nproc-per-node={world} (times nodes)")
        return [fn(*args)]
    check_local_capacity(world)
    # lazy: start-up: a command loads runtime.launch only when it runs
    from threefold.runtime.launch import LaunchError, launch
    try:
        return launch(fn, world, *args, timeout=timeout)
    except LaunchError as exc:
        plan_errors = [m for m in exc.errors.values() if m.startswith("PlanError: ")]
        if plan_errors:  # bad input found on the ranks: report it once, as bad input
            raise PlanError(plan_errors[0].splitlines()[0][len("PlanError: "):]) from None
        full = [r for r, m in exc.errors.items() if _disk_full_text(str(m))]
        if full:         # a full disk on a rank: one line naming it, not the rank's traceback
            # lazy: start-up: a command loads outdir only when it runs
            from threefold.outdir import disk_full
            raise PlanError(f"rank {full[0]}: {disk_full()}") from None
        raise SystemExit(f"threefold: {exc}") from None


def _disk_full_text(message: str) -> bool:
    first = message.splitlines()[0] if message else ""
    return any(w in first for w in ("No space left on device", "Disk quota exceeded", "[Errno 28]",
                                    "[Errno 122]", "the disk is full"))


def check_local_capacity(world: int) -> None:
    """Refuse, before spawning anything, a job this machine cannot hold (local runs only)."""
    if under_torchrun():
        return
    check(world)


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
