"""What a checkpoint every K steps costs the step loop: no checkpoints vs today's blocking
save (`--no-save-async`) vs the asynchronous one (checkpoint/async_save.py).

The default `threefold train` job (the embedded GPT, plan pp=2,m=4, batch 16, seq 64, on
local gloo ranks) runs --steps steps three ways, alternating, --reps times each; evaluation
and the end-of-run sample are off so only the checkpoints differ. The time per step is the
wall time between the starts of consecutive steps (so a save's time counts in the step it
follows), averaged over every step but the first (warm-up) and the last (the final save,
which the run waits for whatever the mode). Prints the ratio of each mode to none, and how
long each save held the loop (median).

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
    cost = {m: statistics.median(r["excess_per_save_s"] / (args.every * r["typical_s"]) for r in rs)
            for m, rs in runs.items()}
    out = {"plan": args.plan, "steps": args.steps, "every": args.every, "reps": args.reps,
           "step_s": step, "save_held_s": held, "cost_share": cost,
           "blocking_over_none": step["blocking"] / step["none"], "async_over_none": step["async"] / step["none"],
           "async_over_blocking": step["async"] / step["blocking"]}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"default job ({args.plan}), a checkpoint every {args.every} steps, {args.steps} steps, "
          f"median of {args.reps} runs per mode")
    for m in runs:
        print(f"  {m:<9} {step[m] * 1e3:8.2f} ms/step  ({step[m] / step['none']:.3f}x none); step-time cost "
              f"of the saves {cost[m]:+.1%} (each run's excess over its median step)"
              + (f"; each save held the loop {held[m] * 1e3:.1f} ms" if m != "none" else ""))
    print(f"  async/blocking step time: {out['async_over_blocking']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
