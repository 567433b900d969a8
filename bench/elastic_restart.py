"""What a dead rank costs a `threefold train --max-restarts` job: the time from the SIGKILL
to the first step after the restart, and the steps done again, on the same world and on a
smaller one (THREEFOLD_ELASTIC_DROP_DEAD=1: the dead rank does not come back).

The job is the embedded GPT at --batch 4 --seq 16 on pp=2,dp=2,m=2 (4 local gloo ranks),
a checkpoint every --every steps; a rank is killed right after the checkpoint of step
2*every is published plus --delay seconds (so some steps past the checkpoint are lost).

    python bench/elastic_restart.py [--every 4] [--delay 1.0] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(world: str, args, root: str) -> dict:
    from tests.elastic_job import Job, newest_step
    ckpt = os.path.join(root, f"{world}.ckpt")
    env = {"THREEFOLD_ELASTIC_DROP_DEAD": "1"} if world == "smaller" else {}
    job = Job(os.path.join(root, world), "--plan", "pp=2,dp=2,m=2", "--steps", str(12 * args.every),
              "--save-every", str(args.every), "--ckpt-dir", ckpt, "--max-restarts", "1", "--min-world", "2",
              env=env)
    job.wait_for(lambda: newest_step(ckpt).endswith(f"step_{2 * args.every:09d}"), timeout=900)
    time.sleep(args.delay)
    killed = job.signal_rank(3, signal.SIGKILL)
    got = job.finish(timeout=1200)
    (r,) = got["restarts"]
    return {"kill_to_first_step_s": r["resumed_at"] - killed, "detect_s": r["failed_at"] - killed,
            "steps_lost": r["steps_lost"], "interval": args.every, "old_plan": r["old_plan"],
            "new_plan": r["new_plan"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    root = tempfile.mkdtemp(prefix="threefold-bench-elastic-")
    try:
        out = {w: _one(w, args, root) for w in ("same", "smaller")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for w, r in out.items():
        print(f"{w:<8} world: SIGKILL -> first step after restart {r['kill_to_first_step_s']:.1f} s (failure "
              f"seen after {r['detect_s']:.1f} s), {r['steps_lost']} step(s) lost (interval {r['interval']}); "
              f"{r['old_plan']} -> {r['new_plan']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
