"""What a checkpoint every K steps costs the step loop: no checkpoints vs today's blocking
save (`--no-save-async`) vs the asynchronous one (checkpoint/async_save.py).

The default `threefold train` job (the embedded GPT, plan pp=2,m=4, batch 16, seq 64, on
local gloo ranks) runs --steps steps three ways, alternating, --reps times each; evaluation
and the end-of-run sample are off so only the checkpoints differ. The time per step is the
wall time between the starts of consecutive steps (so a save's time counts in the step it
follows), averaged over every step but the first (warm-up) and the last (the final save,
which the run waits for whatever the mode). Prints, side by side for the three modes of one
run: the step time and its ratio to none, the step-time cost of the saves (median and worst
of the reps), how long each save held the loop, and the load average before and after
(`os.getloadavg()`: quiet or loaded, against the core count).

    python bench/checkpoint_async.py [--steps 100] [--every 20] [--reps 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

WINDOW = 5      # steps after a save whose excess time is counted as the save's
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(mode: str, args, root: str) -> dict:
    from threefold.cli.train_cmd import _train_rank
    from threefold.config import load_config
    from threefold.runtime.launch import launch
    over = {"steps": args.steps, "eval_every": 0, "sample_tokens": 0, "plan": args.plan,
            "save_every": 0 if mode == "none" else args.every, "save_async": mode == "async"}
    cfg = load_config(None, over)
    ckpt = tempfile.mkdtemp(prefix=f"ckpt-{mode}-", dir=root)
    try:
        world = 1
        from threefold.plan import Plan
        world = Plan.parse(args.plan).world_size
        result = launch(_train_rank, world, cfg, False, ckpt, None, None, timeout=1800)[0]
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    walls = result["step_walls"]
    gaps = [b - a for a, b in zip(walls[:-1], walls[1:])]    # gaps[i]: step i+1 and what followed it
    steady = gaps[1:-1]                                       # not the first (warm-up), not the last
    typical = statistics.median(steady)
    held = [h["held_s"] for h in result["checkpoints_held"][:-1]]   # the last: the final save
    # what each save added: the excess over the typical step of the step it follows and of
    # the WINDOW steps after it (an asynchronous write overlaps those)
    saves = range(args.every, args.steps, args.every)    # the same steps without saves: the control
    excess = [sum(g - typical for g in gaps[s - 1:s - 1 + WINDOW]) for s in saves]
    return {"step_s": statistics.mean(steady), "typical_s": typical, "held_s": statistics.median(held) if held else 0.0,
            "excess_per_save_s": statistics.mean(excess) if excess else 0.0, "saves": len(held)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--plan", default="pp=2,m=4")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    load_before = os.getloadavg()
    root = tempfile.mkdtemp(prefix="threefold-bench-ckpt-")
    runs: dict[str, list[dict]] = {"none": [], "blocking": [], "async": []}
    try:
        for _ in range(args.reps):
            for mode in runs:
                runs[mode].append(_run(mode, args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    step = {m: statistics.median(r["step_s"] for r in rs) for m, rs in runs.items()}
    held = {m: statistics.median(r["held_s"] for r in rs) for m, rs in runs.items()}
    # on a busy machine whole runs differ more than the saves cost: the robust figure is each
    # run's own excess per save over its own typical step, as a share of K steps
    shares = {m: [r["excess_per_save_s"] / (args.every * r["typical_s"]) for r in rs] for m, rs in runs.items()}
    cost = {m: statistics.median(v) for m, v in shares.items()}
    worst = {m: max(v) for m, v in shares.items()}
    worst_step = {m: max(r["step_s"] for r in rs) for m, rs in runs.items()}
    load_after, cores = os.getloadavg(), os.cpu_count() or 1
    loaded = max(load_before[0], load_after[0]) > 0.5 * cores
    out = {"plan": args.plan, "steps": args.steps, "every": args.every, "reps": args.reps,
           "loadavg_before": load_before, "loadavg_after": load_after, "cores": cores,
           "machine": "loaded" if loaded else "quiet",
           "step_s": step, "worst_step_s": worst_step, "save_held_s": held, "cost_share": cost,
           "worst_cost_share": worst,
           "blocking_over_none": step["blocking"] / step["none"], "async_over_none": step["async"] / step["none"],
           "async_over_blocking": step["async"] / step["blocking"]}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"default job ({args.plan}), a checkpoint every {args.every} steps, {args.steps} steps, "
          f"{args.reps} runs per mode (alternating); {out['machine']}: load average "
          f"{' '.join(f'{x:.1f}' for x in load_before)} before, {' '.join(f'{x:.1f}' for x in load_after)} after, "
          f"{cores} cores")
    print(f"  {'mode':<9} {'ms/step':>9} {'worst':>9} {'x none':>7} {'cost':>8} {'worst':>8} {'held/save':>10}")
    for m in runs:
        print(f"  {m:<9} {step[m] * 1e3:9.2f} {worst_step[m] * 1e3:9.2f} {step[m] / step['none']:7.3f} "
              f"{cost[m]:+8.1%} {worst[m]:+8.1%} " + (f"{held[m] * 1e3:8.1f}ms" if m != "none" else f"{'-':>10}"))
    print("  cost: each run's excess over its own median step in the steps after a save, as a share of "
          f"{args.every} steps (median and worst of the reps)")
    print(f"  async/blocking step time: {out['async_over_blocking']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
