"""Why interleaved and ZB-V lose to 1F1B at pp=4 on 2 cores: context switches and core placement.

pp gloo ranks x 1 thread (4 by default) on this machine's cores, the model of
bench/pipeline_bubbles.py, m=8. One launched
job; threefold's 1f1b, interleaved (v=2) and zbv (v=2) in a rotation (paired rounds, a
barrier on the default group before and after every timed step), each under one or more
core placements set for the step only (os.sched_setaffinity, restored after it):

  free   no pinning: the kernel's scheduler places the 4 ranks on the 2 cores (today's runs)
  pair   ranks 0,1 on core 0 and 2,3 on core 1: neighbours share a core
  alt    ranks 0,2 on core 0 and 1,3 on core 1: neighbours on different cores

Per contender: rank 0's wall time (barrier to barrier), paired ratios to `1f1b free` and to
1f1b under the same placement, CPU per
step summed over the ranks (all threads; of it in the kernel; the main thread's), and per step summed over the ranks the voluntary (a thread
blocked: a wait on a receive, a send, a barrier) and involuntary (preempted while runnable)
context switches of every thread of the rank (getrusage RUSAGE_SELF: the main thread and
gloo's transport threads).

    python bench/pipeline_cores.py [--pp 4] [--iters N] [--warmup N] [--placements free,pair,alt]
                                   [--schedules 1f1b,interleaved,zbv] [--m 8] [--lookaheads 8,1]

--lookaheads adds a variant of every contender per value: receives posted that many computes
ahead of their reader (runtime/receives.py; 8 is the engine's), to see whether posting late
(fewer wake-ups of a computing rank by its transport thread, more waiting) pays on shared cores.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import pipeline_bubbles as pb  # noqa: E402

PP = 4
V = {"1f1b": 1, "interleaved": 2, "zbv": 2, "zb-h1": 1}


def cores_for(placement: str, rank: int, ncores: int) -> set[int] | None:
    if placement == "free" or ncores < 2:
        return None
    if placement == "pair":
        return {(rank * ncores) // PP}
    if placement == "alt":
        return {rank % ncores}
    raise SystemExit(f"unknown placement {placement!r}: use free, pair or alt")


def rank_job(args) -> dict:
    global PP
    PP = args["pp"]
    torch.set_num_threads(1)
    pb.PP = PP
    rank = dist.get_rank()
    cfg = pb.Config(pp=PP, ms=(args["m"],))
    everywhere = os.sched_getaffinity(0)
    ncores = len(everywhere)
    contenders = []
    for kind in args["schedules"]:
        step, _, pm = pb.threefold_contender(cfg, kind, V[kind], args["m"], with_pm=True)
        for placement, lookahead in [(p, la) for p in args["placements"] for la in args["lookaheads"]]:
            cores = cores_for(placement, rank, ncores)

            def run(step=step, cores=cores, pm=pm, lookahead=lookahead):
                if lookahead is not None:   # receives posted this many computes ahead
                    from threefold.runtime.receives import receive_plan
                    eng = pm.engine
                    eng._plan_cache = (eng.schedule, receive_plan(eng.schedule.actions[eng.stage], lookahead))
                if cores is not None:
                    os.sched_setaffinity(0, cores)     # the main thread; gloo's threads follow below
                    for tid in os.listdir("/proc/self/task"):
                        os.sched_setaffinity(int(tid), cores)
                try:
                    return step()
                finally:
                    if cores is not None:
                        for tid in os.listdir("/proc/self/task"):
                            os.sched_setaffinity(int(tid), everywhere)
            la = "" if lookahead is None else f" la{lookahead}"
            contenders.append((f"{kind} {placement}{la}", run))
    names = [n for n, _ in contenders]
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    vol = {n: [] for n in names}
    invol = {n: [] for n in names}
    sys_ = {n: [] for n in names}
    main = {n: [] for n in names}
    k = len(contenders)
    for it in range(args["warmup"] + args["iters"]):
        order = contenders[it % k:] + contenders[:it % k]
        if (it // k) % 2:
            order.reverse()
        for name, fn in order:
            dist.barrier()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            m0 = time.thread_time()
            t = time.perf_counter()
            fn()
            m1 = time.thread_time()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            dist.barrier()
            dt = time.perf_counter() - t
            if it >= args["warmup"]:
                wall[name].append(dt)
                cpu[name].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
                vol[name].append(r1.ru_nvcsw - r0.ru_nvcsw)
                invol[name].append(r1.ru_nivcsw - r0.ru_nivcsw)
                sys_[name].append(r1.ru_stime - r0.ru_stime)
                main[name].append(m1 - m0)
    return {"wall": wall, "cpu": cpu, "vol": vol, "invol": invol, "sys": sys_, "main": main}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--lookaheads", default="",
                    help="e.g. 8,1: each schedule also with receives posted that many computes ahead "
                         "(runtime/receives.py; default: the engine's own)")
    ap.add_argument("--placements", default="free,pair,alt")
    ap.add_argument("--schedules", default="1f1b,interleaved,zbv")
    a = ap.parse_args(argv)
    global PP
    PP = a.pp
    args = {"pp": a.pp, "iters": a.iters, "warmup": a.warmup, "m": a.m, "placements": a.placements.split(","),
            "schedules": a.schedules.split(","),
            "lookaheads": [int(x) for x in a.lookaheads.split(",")] if a.lookaheads else [None]}
    from threefold.runtime.launch import launch
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    ranks = launch(rank_job, PP, args, threads=1, timeout=3600)
    names = list(ranks[0]["wall"])
    base = names[0]
    print(f"pp={PP}, m={a.m}, {os.cpu_count()} cores, {a.iters} rounds; load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; per step: wall = rank 0 median, cpu/switches = summed over ranks, median")
    print(f"{'contender':<20} {'wall ms':>8} {'/' + base:>16} {'/1f1b same':>10} {'cpu ms':>8} {'of it sys':>9} {'main thr':>8} "
          f"{'vol csw':>8} {'invol csw':>9}   vol per rank")
    for n in names:
        w = ranks[0]["wall"][n]
        paired = statistics.median(x / y for x, y in zip(w, ranks[0]["wall"][base]))
        same = "1f1b " + n.split(" ", 1)[1]     # 1f1b under the same placement (and lookahead), paired
        to_same = statistics.median(x / y for x, y in zip(w, ranks[0]["wall"][same])) if (
            same in ranks[0]["wall"]) else float("nan")
        tot = lambda key: statistics.median(sum(c) for c in zip(*(r[key][n] for r in ranks)))  # noqa: E731
        per = [statistics.median(r["vol"][n]) for r in ranks]
        print(f"{n:<20} {statistics.median(w)*1e3:>8.0f} {paired:>16.3f} {to_same:>10.3f} {tot('cpu')*1e3:>8.0f} "
              f"{tot('sys')*1e3:>9.0f} {tot('main')*1e3:>8.0f} "
              f"{tot('vol'):>8.0f} {tot('invol'):>9.0f}   {per}")
    print(f"(bench wall {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
