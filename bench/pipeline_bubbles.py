"""Pipeline schedules where bubbles are real: pp=2 on 2 gloo ranks, one per core.

With more ranks than cores an idle rank lends its core to another, so bubbles cost
nothing (bench/pipeline_vs_torch.py runs 4 ranks on 2 cores). Here each rank has a core of
its own and one thread, and a stage step takes tens of milliseconds, so the schedule shows.

For each m in {2, 4, 8} (the global batch fixed, so microbatches shrink as m grows), one
launched 2-rank job runs, iterations interleaved (the order rotates every round; a barrier
on the default group before and after each timed iteration):

  * threefold: 1f1b, interleaved (v=2) and, where runtime/schedule.py has them, zb-h1 and
    zbv (v=2, V placement);
  * torch.distributed.pipelining on the same model and the same layer split: Schedule1F1B,
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble (stages
    in loop order, the V order for ZBV), each on its own gloo group;
  * eager: the whole batch in one process, one thread (rank 0; rank 1 waits in the barrier).

Reported per m: each contender's median wall time (rank 0, barrier to barrier), its paired
median ratio to torch's best schedule (the torch contender with the lowest median, each
round's pair) and to the limit (eager / 2: the serial step split over 2 cores, each round's
eager); and the bubble: measured (one more instrumented iteration: idle rank-time / (2 x
makespan), idle = not inside a forward, backward or weight-gradient compute), simulated
with unit costs (runtime/simulate.py) and simulated with the measured per-chunk compute
times. Goals (issue 13): threefold's best <= 0.85x torch's best; within 1.15x the limit at m=8.

The limit leaves out two costs no schedule can remove: microbatches of batch/m rows run
less efficiently than the whole batch, and two busy cores run slower than one. The floor
contender measures both: each rank runs the whole model over its half of the m
microbatches, both ranks at once; floor / limit is what they cost, contender / floor what
the pipeline adds (bubble, communication, runtime).

    python bench/pipeline_bubbles.py [--quick] [--json] [--ms 2,4,8] [--iters N] [--warmup N] [--pp 4]

--pp 4 runs the same on 4 ranks (two per core: bubbles then cost less, an idle rank lends
its core); the limit stays eager / 2 (two cores). Each threefold schedule is also reported
against threefold's 1f1b, paired per round (issue 25), with minor page faults per step.
--p2p-gloo adds each threefold schedule again with THREEFOLD_LOCAL_P2P=0 ("... gloo": its
pipeline messages through gloo instead of shared memory, runtime/local_p2p.py), reported
against the 1f1b of the same transport; --no-torch leaves torch's schedules out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from pipeline_vs_torch import TorchStage, build_workload, run_rotation, with_gloo_p2p  # noqa: E402

PP = 2
THREEFOLD = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]
# torch schedule -> (chunks per rank, placement, the threefold schedule it corresponds to)
TORCH = {"Schedule1F1B": (1, "loop", "1f1b"), "ScheduleInterleaved1F1B": (2, "loop", "interleaved"),
         "ScheduleInterleavedZeroBubble": (2, "loop", None), "ScheduleZBVZeroBubble": (2, "v", "zbv")}


@dataclass(frozen=True)
class Config:
    n_layer: int = 8
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 256
    seq: int = 128
    batch: int = 16            # global batch: microbatches of batch/m
    pp: int = 2                # pipeline ranks
    ms: tuple = (2, 4, 8)
    warmup: int = 2
    iters: int = 10
    threefold: tuple = field(default_factory=tuple)   # filled in: the schedules this tree has
    torch: tuple = field(default_factory=tuple)
    p2p_gloo: bool = False     # each threefold schedule also with its messages through gloo


QUICK = dict(n_layer=4, n_embd=64, seq=32, batch=8, ms=(2, 4), warmup=1, iters=3)


def available_threefold() -> tuple:
    from threefold.plan import SCHEDULES
    return tuple((k, v) for k, v in THREEFOLD if k in SCHEDULES)


def available_torch() -> tuple:
    import torch.distributed.pipelining as pipelining
    return tuple(name for name in TORCH if hasattr(pipelining, name))


def stage_rank(stage: int, v: int, placement: str) -> int:
    if v == 1 or placement == "loop":
        return stage % PP
    return stage if stage < PP else 2 * PP - 1 - stage


def bounds(cfg: Config, v: int) -> list[int]:
    k = PP * v
    if cfg.n_layer % k:
        raise SystemExit(f"n_layer={cfg.n_layer} must be a multiple of pp*v={k} for layer-aligned splits")
    return [cfg.n_layer // k * i for i in range(k + 1)]


def threefold_plan(cfg: Config, kind: str, v: int, m: int) -> str:
    split = "+".join(f"h.{i}" for i in bounds(cfg, v)[1:-1])
    return f"pp={PP},m={m},schedule={kind}" + (f",v={v}" if v > 1 else "") + f",split={split}"


# ---- one rank ------------------------------------------------------------------------------

class ComputeClock:
    """Wraps compute calls (instance attributes) and adds up their wall time per label."""

    def __init__(self):
        self.spans: list[tuple[str, int, float]] = []   # (label F/B/W, chunk, seconds)
        self.saved: list = []

    def wrap(self, obj, attr: str, label: str, chunk_of) -> None:
        fn = getattr(obj, attr)
        self.saved.append((obj, attr))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((label, chunk_of(args), time.perf_counter() - t))
        setattr(obj, attr, timed)

    def unwrap(self) -> None:
        for obj, attr in self.saved:
            obj.__dict__.pop(attr, None)
        self.saved = []


def threefold_contender(cfg: Config, kind: str, v: int, m: int, with_pm: bool = False):
    import threefold
    w = build_workload(cfg)
    pm = threefold.parallelize(w["model"], threefold_plan(cfg, kind, v, m), w["inputs"], w["loss_fn"],
                               target=w["target"])

    def step():
        pm.zero_grad()
        return pm.step(*w["inputs"], target=w["target"])

    def instrument(clock: ComputeClock) -> None:
        eng = pm.engine
        for attr, label in (("_forward", "F"), ("_backward_action", "B"), ("_weight_action", "W")):
            if hasattr(eng, attr):
                clock.wrap(eng, attr, label, lambda args: args[1].chunk)
    return (step, instrument, pm) if with_pm else (step, instrument)


def torch_contender(cfg: Config, name: str, m: int, rank: int, group):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage
    v, placement, _ = TORCH[name]
    w = build_workload(cfg)
    b = bounds(cfg, v)
    k = PP * v
    stages, mods = [], []
    for s in range(k):
        if stage_rank(s, v, placement) != rank:
            continue
        mod = TorchStage(w["model"], b[s], b[s + 1], s == 0, s == k - 1)
        mods.append(mod)
        stages.append(PipelineStage(mod, s, k, torch.device("cpu"), group=group))
    cls = getattr(pipelining, name)
    sched = cls(stages[0] if v == 1 else stages, m, loss_fn=w["loss_fn"])
    first = stage_rank(0, v, placement) == rank
    last = stage_rank(k - 1, v, placement) == rank
    idx, target = w["inputs"][0], w["target"]

    def step():
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        losses = [] if last else None
        sched.step(*((idx,) if first else ()), target=target if last else None, losses=losses,
                   return_outputs=False)
        return float(torch.stack(losses).detach().sum()) / m if last else None

    def instrument(clock: ComputeClock) -> None:
        for st in stages:
            chunk = st.stage_index
            clock.wrap(st, "forward_one_chunk", "F", lambda args, c=chunk: c)
            clock.wrap(st, "backward_one_chunk", "B", lambda args, c=chunk: c)
            if hasattr(st, "backward_weight_one_chunk"):
                clock.wrap(st, "backward_weight_one_chunk", "W", lambda args, c=chunk: c)
    return step, instrument


def measure_bubble(step, instrument) -> dict:
    """One instrumented iteration: this rank's start, end and compute spans (shared clock)."""
    clock = ComputeClock()
    instrument(clock)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        dist.barrier()
    finally:
        clock.unwrap()
    return {"start": t0, "end": t1, "spans": clock.spans}


def rank_job(cfg: Config) -> dict:
    global PP
    PP = cfg.pp
    torch.set_num_threads(1)
    rank = dist.get_rank()
    from threefold.runtime.allocator import APPLIED
    out = {"malloc": dict(APPLIED)}   # runtime/allocator.py's settings (THREEFOLD_MALLOC=default: none)
    for m in cfg.ms:
        contenders, instruments = [], {}
        for kind, v in cfg.threefold:
            step, inst = threefold_contender(cfg, kind, v, m)
            contenders.append((f"threefold {kind}", step))
            instruments[f"threefold {kind}"] = (step, inst)
            if cfg.p2p_gloo:
                step, inst = threefold_contender(cfg, kind, v, m)
                with_gloo_p2p(step)
                contenders.append((f"threefold {kind} gloo", step))
                instruments[f"threefold {kind} gloo"] = (step, inst)
        for name in cfg.torch:
            group = dist.new_group(list(range(PP)))   # torch's p2p on a gloo context of its own
            step, inst = torch_contender(cfg, name, m, rank, group)
            contenders.append((f"torch {name}", step))
            instruments[f"torch {name}"] = (step, inst)
        ew = build_workload(cfg)

        def eager():
            if rank != 0:
                return None
            ew["model"].zero_grad(set_to_none=True)
            loss = ew["loss_fn"](ew["model"](*ew["inputs"]), ew["target"])
            loss.backward()
            return float(loss.detach())

        def floor():
            # each rank: the whole model over its half of the m microbatches, both at once:
            # the work a bubble-free, overhead-free pipeline gives a core, at the same
            # microbatch size and with both cores busy (what eager / 2 leaves out)
            ew["model"].zero_grad(set_to_none=True)
            rows = cfg.batch // m
            for mb in range(rank * m // PP, (rank + 1) * m // PP):
                sl = slice(mb * rows, (mb + 1) * rows)
                loss = ew["loss_fn"](ew["model"](ew["inputs"][0][sl]), ew["target"][sl]) / m
                loss.backward()
            return None
        contenders.append(("eager", eager))
        contenders.append(("floor", floor))
        faults: dict = {}
        times, cpu, losses = run_rotation(contenders, cfg.warmup, cfg.iters, faults)
        bubbles = {name: measure_bubble(*fns) for name, fns in instruments.items()}
        out[m] = {"times": times, "cpu": cpu, "losses": losses, "bubbles": bubbles, "faults": faults}
        dist.barrier()
    return out


# ---- parent: simulator, summary, report ------------------------------------------------------

def measured_bubble(per_rank: list[dict]) -> tuple[float, dict]:
    """idle rank-time / (pp * makespan), and the mean compute time per (chunk, F/B/W)."""
    start = min(r["start"] for r in per_rank)
    makespan = max(r["end"] for r in per_rank) - start
    busy = [sum(s for _, _, s in r["spans"]) for r in per_rank]
    durations: dict = {}
    for r in per_rank:
        for label, chunk, s in r["spans"]:
            durations.setdefault((chunk, label), []).append(s)
    mean = {k: statistics.mean(v) for k, v in durations.items()}
    return sum(makespan - b for b in busy) / (len(per_rank) * makespan), mean


def simulated_bubbles(kind: str, v: int, m: int, mean: dict) -> dict:
    from threefold.runtime.schedule import make_schedule
    from threefold.runtime.simulate import simulate
    sched = make_schedule(kind, PP, m, v)
    unit = simulate(sched).bubble_fraction
    table = {}
    for c in range(PP * v):
        f, b, w = (mean.get((c, x), 0.0) for x in "FBW")
        table[c] = (f, b, w) if sched.splits_backward else (f, b + w)
    return {"sim_unit": unit, "sim_measured_costs": simulate(sched, table).bubble_fraction}


def summarize(cfg: Config, ranks: list[dict]) -> dict:
    rows = {}
    for m in cfg.ms:
        r0 = ranks[0][m]
        times = r0["times"]
        med = {n: statistics.median(t) for n, t in times.items()}
        torch_names = [n for n in times if n.startswith("torch ")]
        best = min(torch_names, key=med.get) if torch_names else None
        contenders = {}
        for n, t in times.items():
            if n in ("eager", "floor"):
                continue
            row = {"wall_s": med[n], "vs_limit_paired": statistics.median(
                [x / (e / 2) for x, e in zip(t, times["eager"])])}
            # minor page faults per step, the median over iterations, the larger of the two ranks
            row["faults_per_step"] = max(statistics.median(rk[m]["faults"][n]) for rk in ranks)
            base = "threefold 1f1b" + (" gloo" if n.endswith(" gloo") else "")
            if n.startswith("threefold ") and base in times:
                row["vs_1f1b_paired"] = statistics.median([x / y for x, y in zip(t, times[base])])
            if n + " gloo" in times:     # --p2p-gloo: shared-memory messages against gloo's, paired
                row["vs_gloo_paired"] = statistics.median([x / y for x, y in zip(t, times[n + " gloo"])])
            if "floor" in times:
                row["vs_floor_paired"] = statistics.median([x / f for x, f in zip(t, times["floor"])])
            if best:
                row["vs_torch_best_paired"] = statistics.median([x / y for x, y in zip(t, times[best])])
            bub, mean = measured_bubble([rk[m]["bubbles"][n] for rk in ranks])
            row["bubble_measured"] = bub
            kind, v = _threefold_kind(n)
            if kind:
                row.update(simulated_bubbles(kind, v, m, mean))
            row["loss"] = next((rk[m]["losses"][n] for rk in ranks if rk[m]["losses"][n] is not None), None)
            contenders[n] = row
        ours = [n for n in contenders if n.startswith("threefold ")]
        ours_best = min(ours, key=med.get) if ours else None
        floor = {"floor_s": med["floor"], "floor_vs_limit_paired": statistics.median(
            [f / (e / 2) for f, e in zip(times["floor"], times["eager"])])} if "floor" in times else {}
        rows[m] = {"eager_s": med["eager"], "limit_s": med["eager"] / 2, **floor, "torch_best": best,
                   "threefold_best": ours_best, "contenders": contenders,
                   "raw_wall_s": times}
    return {"config": asdict(cfg), "ranks": PP, "cores": os.cpu_count(), "rows": rows,
            "malloc": ranks[0].get("malloc", {})}


def _threefold_kind(name: str) -> tuple:
    if name.startswith("threefold "):
        kind = name.split(" ")[1]
        return kind, dict(THREEFOLD)[kind]
    v, _, kind = TORCH[name.split(" ", 1)[1]]
    return kind, v


def report(s: dict) -> str:
    c = s["config"]
    lines = [f"GPT n_layer={c['n_layer']} n_embd={c['n_embd']} n_head={c['n_head']} vocab={c['vocab_size']} "
             f"seq={c['seq']} global batch={c['batch']}; pp={s['ranks']} on {s['ranks']} gloo ranks x 1 thread "
             f"({s['cores']} cores); medians of {c['iters']} rotating rounds after {c['warmup']} warm-up; "
             f"load average before/after {s['loadavg'][0]:.1f}/{s['loadavg'][1]:.1f}",
             "ratios are paired medians (each round's pair); limit = eager / 2; bubble = idle/(2 x makespan), "
             "measured | simulated unit costs | simulated with the measured compute times; "
             f"faults = minor page faults per step (the larger rank); rank malloc settings: {s['malloc'] or 'glibc defaults'}",
             ""]
    for m, r in s["rows"].items():
        lines.append(f"m={m}: eager {r['eager_s']*1e3:.0f} ms, limit {r['limit_s']*1e3:.0f} ms; torch best: "
                     f"{r['torch_best']}; threefold best: {r['threefold_best']}")
        if "floor_s" in r:
            lines.append(f"  floor (both cores, each the whole model over m/2 microbatches of {c['batch'] // m}) "
                         f"{r['floor_s']*1e3:.0f} ms = {r['floor_vs_limit_paired']:.3f} x limit")
        lines.append(f"  {'contender':<40} {'wall ms':>8} {'/1f1b':>6} {'/torch best':>11} {'/limit':>7} {'/floor':>7} "
                     f"{'bubble meas':>11} {'sim unit':>8} {'sim meas':>8} {'faults':>7} {'loss':>9}")
        for n, x in r["contenders"].items():
            sim_u = f"{x['sim_unit']:.3f}" if "sim_unit" in x else "-"
            sim_m = f"{x['sim_measured_costs']:.3f}" if "sim_measured_costs" in x else "-"
            loss = f"{x['loss']:.5f}" if x["loss"] is not None else "-"
            lines.append(f"  {n:<40} {x['wall_s']*1e3:>8.0f} {x.get('vs_1f1b_paired', float('nan')):>6.3f} "
                         f"{x.get('vs_torch_best_paired', float('nan')):>11.3f} "
                         f"{x['vs_limit_paired']:>7.3f} {x.get('vs_floor_paired', float('nan')):>7.3f} "
                         f"{x['bubble_measured']:>11.3f} {sim_u:>8} {sim_m:>8} {x['faults_per_step']:>7.0f} {loss:>9}")
        gloo = {n: x["vs_gloo_paired"] for n, x in r["contenders"].items() if "vs_gloo_paired" in x}
        if gloo:
            lines.append("  shared-memory messages / gloo, paired: " + ", ".join(
                f"{n.split(' ', 1)[1]} {x:.3f}" for n, x in gloo.items()))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, m in {2, 4}, few rounds")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--p2p-gloo", action="store_true",
                    help="each threefold schedule also with THREEFOLD_LOCAL_P2P=0 (messages through gloo)")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's schedules out")
    ap.add_argument("--ms", type=lambda t: tuple(int(x) for x in t.split(",")), help="microbatch counts, e.g. 2,4,8")
    for f in ("n_layer", "n_embd", "n_head", "vocab_size", "seq", "batch", "warmup", "iters", "pp"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, dest=f)
    args = ap.parse_args(argv)
    over = dict(QUICK) if args.quick else {}
    over.update({k: v for k, v in vars(args).items() if k in Config.__dataclass_fields__ and v is not None})
    cfg = Config(**over, threefold=available_threefold(), torch=() if args.no_torch else available_torch())
    global PP
    PP = cfg.pp
    for m in cfg.ms:
        if cfg.batch % m:
            raise SystemExit(f"batch={cfg.batch} must be a multiple of every m (got m={m})")

    from threefold.runtime.launch import launch
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    ranks = launch(rank_job, PP, cfg, threads=1, timeout=3600)
    s = summarize(cfg, ranks)
    s["loadavg"] = [load0, os.getloadavg()[0]]
    s["bench_wall_s"] = time.perf_counter() - t0
    print(json.dumps(s, indent=2, default=str) if args.json else report(s) + f"(bench wall {s['bench_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
