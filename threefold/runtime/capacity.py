"""How many local ranks this machine can hold: the guard `threefold.launch` and every CLI
command that starts local ranks apply before spawning anything (torchrun jobs are sized by
their launcher, not here)."""
from __future__ import annotations

import os

from threefold.errors import PlanError

RANK_MEMORY_BYTES = 300 << 20    # a gloo rank with torch imported, before the model


def max_local_ranks() -> int:
    """How many local processes this machine can sensibly run (THREEFOLD_MAX_LOCAL_RANKS
    overrides): four per core, at least 8, so small meshes work on a laptop."""
    env = os.environ.get("THREEFOLD_MAX_LOCAL_RANKS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise PlanError(f"THREEFOLD_MAX_LOCAL_RANKS={env!r} is not an integer") from None
    return max(8, 4 * (os.cpu_count() or 1))


def check_local_capacity(world: int) -> None:
    """Refuse a local job of `world` ranks this machine cannot hold, with the fix."""
    limit = max_local_ranks()
    if world > limit:
        raise PlanError(f"the plan needs {world} ranks (tp*cp*dp*pp), more than this machine runs locally "
                        f"({limit}: 4 per core); lower tp/pp/dp, set THREEFOLD_MAX_LOCAL_RANKS, or use torchrun")
    available = available_memory()
    if available is not None and world * RANK_MEMORY_BYTES > available:
        raise PlanError(f"the plan needs {world} local ranks, about {world * RANK_MEMORY_BYTES >> 20} MiB "
                        f"before the model, but {available >> 20} MiB is available; lower tp/pp/dp or use torchrun")


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
