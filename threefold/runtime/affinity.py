"""THREEFOLD_PIN=cores: each local rank runs on cores of its own instead of wherever the
kernel's scheduler puts it.

Why: a pipeline rank sleeps in a receive and is woken by its neighbour's send. Left free,
Linux tends to wake a task on or near the core of the task that woke it, so on a small
machine neighbouring ranks pile up on one core while another core runs something else, and
every wake-up may move a rank (and its cache) to another core. On this project's 2-core
machine with 4 pipeline ranks (bench/pipeline_cores.py, paired per step) pinning rank r
to core r mod 2, so that neighbours sit on different cores, cut the step's wall time by
7-32% for 1F1B, interleaved and ZB-V alike, and the CPU it took by 4-6%, while other jobs
loaded the machine; on the quiet machine it did not help (BENCHMARKS.md, "Wave 9").

Which cores: the rank's share of the cores this process may use (os.sched_getaffinity,
which respects taskset / cgroup cpusets), in order. With enough cores for every rank's
threads, rank r gets its own block of `threads` cores; with fewer (more ranks than cores),
blocks wrap around, so rank r and rank r + cores/threads share cores while neighbours do
not. Set before the process group starts, so gloo's transport threads (and torch's
intra-op threads) inherit it; threads the process already has are pinned too.

Off by default (the kernel decides): other jobs on the machine cannot move our ranks off a
core they have taken. THREEFOLD_PIN=none is the same as unset; anything else is a PlanError.
"""
from __future__ import annotations

import os

from threefold.errors import PlanError

ENV = "THREEFOLD_PIN"
MODES = ("none", "cores")


def mode() -> str:
    """THREEFOLD_PIN's value, checked: "none" (default) or "cores"."""
    value = os.environ.get(ENV, "none").strip().lower() or "none"
    if value not in MODES:
        raise PlanError(f"{ENV}={os.environ[ENV]!r} is invalid: use {ENV}=cores (pin each local rank to "
                        f"cores of its own) or {ENV}=none (the default: the kernel places ranks)")
    return value


def rank_cores(local_rank: int, threads: int, allowed: list[int]) -> list[int]:
    """The cores of `allowed` that local rank `local_rank` with `threads` threads runs on:
    consecutive blocks of `threads` cores, wrapping around when there are too few."""
    n = len(allowed)
    threads = max(1, min(threads, n))
    start = (local_rank * threads) % n
    return [allowed[(start + i) % n] for i in range(threads)]


def pin_rank(local_rank: int, threads: int) -> list[int] | None:
    """Pin this process (and the threads it starts from now on) when THREEFOLD_PIN=cores;
    returns the cores, or None when pinning is off or not available on this system."""
    if mode() == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = rank_cores(local_rank, threads, sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, cores)
    # threads already started (the launcher's parent watch, torch's own) follow too
    tasks = "/proc/self/task"
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else ():
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:     # a thread that just ended
            pass
    return cores
