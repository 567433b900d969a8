"""Which rank is slow, and how slow: a straggler is reported, never killed.

A rank that dies or stops ends the job (runtime/launch.py) and, under --max-restarts, the
job restarts (train/elastic.py). A rank that only runs slowly (a throttled chip, a busy
neighbour on its cores) slows every rank, since each waits on it, so the step time alone
cannot say which: this measures each rank's own compute, the wall time inside its chunks'
forwards (no waiting on peers in it, outside tensor-parallel collectives), and compares it
with that rank's usual time (the median of its first steps: stages differ in work, so a
rank is compared only with itself). A rank that takes over FACTOR times its usual time for
STREAK steps in a row, while the other ranks do not, is named, once per streak.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

FACTOR = 3.0        # slower than its usual compute by this much ...
STREAK = 3          # ... for this many steps in a row: a straggler, not noise
WARMUP = 4          # steps measured for the usual time (after the first, which compiles)


class StragglerWatch:
    """Every rank makes one (after parallelize) and calls `end_step` after each step (a
    collective: one float per rank gathered)."""

    def __init__(self, pm):
        self.device = pm.engine.device
        self.seconds = 0.0
        self.history: list[list[float]] = []
        self.usual: list[float] | None = None
        self.slow_for: dict[int, int] = {}
        for mod in pm.engine.modules.values():
            mod.forward = self._timed(mod.forward)

    def _timed(self, forward):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def end_step(self, step: int) -> dict | None:
        """{"step", "rank", "seconds", "usual_seconds", "times"} when a rank has just become
        a straggler (its streak reached STREAK), else None; the same on every rank."""
        mine, self.seconds = self.seconds, 0.0
        times = _gather(mine, self.device)
        if self.usual is None:
            if step > 1:
                self.history.append(times)
            if len(self.history) >= WARMUP:
                self.usual = [statistics.median(col) for col in zip(*self.history)]
            return None
        ratios = [t / u if u > 0 else 1.0 for t, u in zip(times, self.usual)]
        found = None
        for r, ratio in enumerate(ratios):
            others = sorted(x for i, x in enumerate(ratios) if i != r)
            typical = others[len(others) // 2] if others else 1.0
            if ratio > FACTOR and ratio > FACTOR * typical:
                self.slow_for[r] = self.slow_for.get(r, 0) + 1
                if self.slow_for[r] == STREAK and found is None:
                    found = {"step": step, "rank": r, "seconds": times[r], "usual_seconds": self.usual[r],
                             "times": round(ratio, 2)}
            else:
                self.slow_for.pop(r, None)
        return found


def _gather(value: float, device=None) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    cuda = device is not None and torch.device(device).type == "cuda"
    t = torch.tensor([value], dtype=torch.float64, device=device if cuda else "cpu")
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [float(p) for p in parts]


def describe(found: dict) -> str:
    return (f"rank {found['rank']} is a straggler: its compute took {found['seconds'] * 1e3:.0f} ms at step "
            f"{found['step']}, {found['times']:.1f}x its usual {found['usual_seconds'] * 1e3:.0f} ms, for "
            f"{STREAK} steps in a row (reported, not stopped)")
