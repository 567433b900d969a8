"""Run a function on every rank: under torchrun (env already set) or on local gloo ranks."""
from __future__ import annotations

import os

from threefold.errors import PlanError


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def run_on_ranks(fn, world: int, *args, timeout: float | None = None) -> list:
    """Results of fn(*args) per rank (under torchrun: this rank's result only)."""
    if under_torchrun():
        from threefold.runtime.launch import init_from_env
        init_from_env()
        import torch.distributed as dist
        if dist.get_world_size() != world:
            raise PlanError(f"the plan needs {world} ranks but torchrun started "
                            f"{dist.get_world_size()}; use --nproc-per-node={world} (times nodes)")
        return [fn(*args)]
    from threefold.runtime.launch import LaunchError, launch
    try:
        return launch(fn, world, *args, timeout=timeout)
    except LaunchError as exc:
        plan_errors = [m for m in exc.errors.values() if m.startswith("PlanError: ")]
        if plan_errors:  # bad input found on the ranks: report it once, as bad input
            raise PlanError(plan_errors[0].splitlines()[0][len("PlanError: "):]) from None
        raise SystemExit(f"threefold: {exc}") from None


def is_main_rank() -> bool:
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0
