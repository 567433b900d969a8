"""What a schedule can gain when its ranks share fewer cores than there are ranks.

runtime/simulate.py gives every rank a device of its own, so a bubble is lost time. On this
machine 4 pipeline ranks share 2 cores (bench/pipeline_vs_torch.py, bench/pipeline_bubbles.py
--pp 4): a rank that waits lends its core to another, and most of the bubble a better schedule
removes was never lost. This script runs each schedule's per-rank compute order on `cores`
cores shared fairly among the ranks that can run (processor sharing, as the OS does for
equal-priority busy processes), communication free, and prints the makespan and the gain
over 1F1B, next to the one-device-per-rank figures. It is the bound the wall-time goals of
issue 25 can be read against: a schedule cannot beat 1F1B by more than it gains here.

    python bench/pipeline_share_bound.py [--m 8] [--pp 2,4] [--cores 2] [--contention 0.12]

Costs are the generators' unit costs with the model cut into pp*v equal chunks: a fused
backward is two forwards, split B and W one each, a chunk of a v=2 schedule half a v=1 one.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from threefold.runtime.schedule import Kind, make_schedule  # noqa: E402

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


def unit_costs(kind: str, v: int) -> dict[str, float]:
    split = kind in ("zb-h1", "zbv")
    f, b, w = (1.0, 1.0, 1.0) if split else (1.0, 2.0, 0.0)
    return {"F": f / v, "B": b / v, "W": w / v}


def shared_makespan(schedule, costs: dict[str, float], cores: int,
                    contention: float = 0.0) -> tuple[float, float]:
    """(makespan, core utilisation) of the schedule's compute orders on `cores` cores shared
    equally by the ranks whose next compute has its inputs (each at most one core).
    `contention`: busy cores slow each other down (shared caches, memory bandwidth, SMT
    siblings): with k cores busy each runs at 1 / (1 + contention * (k - 1)) of its speed."""
    pp, last = schedule.pp, schedule.num_chunks - 1
    orders = [[a for a in schedule.actions[r] if a.is_compute] for r in range(pp)]

    def deps(a):
        c, i = a.chunk, a.mb
        if a.kind is Kind.FORWARD:
            return [(Kind.FORWARD, c - 1, i)] if c > 0 else []
        if a.kind is Kind.BACKWARD:
            return [(Kind.FORWARD, c, i)] + ([(Kind.BACKWARD, c + 1, i)] if c < last else [])
        return [(Kind.BACKWARD, c, i)]

    done: set = set()
    pos, left = [0] * pp, [None] * pp
    t = work = 0.0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        ready = [r for r in range(pp) if pos[r] < len(orders[r])
                 and all(d in done for d in deps(orders[r][pos[r]]))]
        if not ready:
            raise RuntimeError(f"{schedule.name}: no rank can run (the order deadlocks)")
        for r in ready:
            if left[r] is None:
                left[r] = costs[orders[r][pos[r]].kind.value]
        busy = min(cores, len(ready))
        speed = min(1.0, cores / len(ready)) / (1 + contention * (busy - 1))
        dt = min(left[r] for r in ready) / speed
        t += dt
        work += dt * min(cores, len(ready))
        for r in ready:
            left[r] -= dt * speed
            if left[r] <= 1e-9:
                a = orders[r][pos[r]]
                done.add((a.kind, a.chunk, a.mb))
                pos[r], left[r] = pos[r] + 1, None
    return t, work / (min(cores, pp) * t)


def table(m: int, pps: list[int], cores: int, contention: float = 0.0) -> list[dict]:
    rows = []
    for pp in pps:
        base = {}
        for kind, v in SCHEDULES:
            sched = make_schedule(kind, pp, m, v)
            costs = unit_costs(kind, v)
            for c in sorted({pp, cores}):
                span, util = shared_makespan(sched, costs, c, contention)
                base.setdefault(c, span)   # 1f1b comes first
                rows.append({"pp": pp, "cores": c, "schedule": kind, "makespan": span,
                             "utilisation": util, "gain_vs_1f1b": 1 - span / base[c]})
    return sorted(rows, key=lambda r: (r["pp"], r["cores"]))   # stable: schedules stay in order


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--pp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--contention", type=float, default=0.0,
                    help="slowdown of each busy core per other busy core (this machine: about 0.12, "
                         "bench/pipeline_bubbles.py's floor / limit over the microbatching cost)")
    args = ap.parse_args(argv)
    print(f"m={args.m}; unit costs; contention {args.contention}; cores = pp is runtime/simulate.py's "
          f"one device per rank")
    print(f"{'pp':>3} {'cores':>5} {'schedule':<12} {'makespan':>9} {'utilisation':>11} {'gain vs 1f1b':>12}")
    for r in table(args.m, args.pp, args.cores, args.contention):
        print(f"{r['pp']:>3} {r['cores']:>5} {r['schedule']:<12} {r['makespan']:>9.2f} {r['utilisation']:>11.3f} "
              f"{r['gain_vs_1f1b']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
