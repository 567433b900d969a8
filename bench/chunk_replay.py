"""Every pipeline rank's compute (F, B, W actions) replayed in one process, one thread.

    python bench/chunk_replay.py [--rounds 6] [--schedules 1f1b,interleaved,zbv] [--profile KIND]

bench/pipeline_overhead.py counts compute on 4 ranks sharing 2 cores: there, context
switches and other ranks' cache traffic land in each rank's thread CPU. This runs the same
generated chunks (pp=4, m=8, GPT 8 x 256, microbatch 2 x 128: pipeline_overhead's default)
through each stage's own schedule order, one stage after another, with no communication:
a stage's received activations and gradients are fixed random tensors. Schedules
alternate per round; CPU ms per step (all 4 stages' F + B + W), median and worst, split
by action kind. What differs between schedules here is what the chunking and the split
cost by themselves.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from pipeline_overhead import Config, plan  # noqa: E402
from pipeline_vs_torch import build_workload  # noqa: E402


def build(cfg: Config, kind: str):
    """(the schedule, chunk index -> a loaded module, the microbatches, the hidden size)."""
    from threefold.codegen.artifact import build_sources, chunk_state
    from threefold.compiler.api import compile_workload
    from threefold.plan import Plan
    from threefold.runtime.loader import import_file
    from threefold.runtime.schedule import make_schedule
    from threefold.workload import Workload
    w = build_workload(cfg)
    p = Plan.parse(plan(cfg, kind))
    prog = compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]), p)
    root = tempfile.mkdtemp(prefix=f"threefold-replay-{kind}-")
    for name, text in build_sources(prog).items():
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    mods = {}
    for c in prog.chunks:
        cls = getattr(import_file(os.path.join(root, f"chunk{c.index:02d}.py")), f"Chunk{c.index}")
        m = cls()
        m.load_state(chunk_state(prog, c, 0))
        mods[c.index] = m
    v = 2 if kind in ("interleaved", "zbv") else 1
    sched = make_schedule(kind, cfg.pp, cfg.m, v)
    per = cfg.batch // cfg.m
    batch = (*w["inputs"], w["target"])
    micro = [tuple(t[i * per:(i + 1) * per] for t in batch) for i in range(cfg.m)]
    return sched, mods, micro, cfg.n_embd


def run_stage(sched, mods, micro, n_embd: int, stage: int, times: dict, split: bool) -> None:
    """One stage's F/B/W actions in its schedule's order, each timed (thread CPU)."""
    from threefold.runtime import weight_grad
    from threefold.runtime.slot import Slot, handed_over, input_grads
    n = sched.num_chunks
    g = torch.Generator().manual_seed(stage)
    # what a receive would hand over: every boundary here is the residual stream
    act = torch.randn(micro[0][0].shape[0], micro[0][0].shape[1], n_embd, generator=g)
    slots, deferred = {}, {}
    for a in sched.compute(stage):
        mod = mods[a.chunk]
        t, flt = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        key = (a.chunk, a.mb)
        if a.kind.value == "F":
            slot = slots.setdefault(key, Slot(inputs=[] if a.chunk == 0 else [act.clone().requires_grad_(True)]))
            mod.rng_key, mod.microbatch = (0, 0, a.mb), a.mb
            mod.weight_stash = deferred.setdefault(key, []) if split else None
            outs = list(mod(*slot.inputs, *[micro[a.mb][j] for j in mod.USER_INPUTS]))
            slot.outputs = outs
            if a.chunk + 1 < n and a.chunk + 1 in mods and sched.stage_of(a.chunk + 1) == stage:
                slots[(a.chunk + 1, a.mb)] = Slot(inputs=handed_over(outs, True))
        elif a.kind.value == "B":
            slot = slots.pop(key)
            if a.chunk == n - 1:
                tensors, grads = [slot.outputs[0]], [torch.full_like(slot.outputs[0], 1.0 / 16)]
            else:
                tensors = [o for o in slot.outputs if o.requires_grad]
                grads = slot.output_grads or [act for _ in tensors]
            torch.autograd.Variable._execution_engine.run_backward(
                tuple(tensors), tuple(grads), False, False, (), True, True)
            slot.input_grads = [x.grad if x.requires_grad else None for x in slot.inputs]
            slot.outputs = slot.output_grads = []
            if a.chunk > 0 and sched.stage_of(a.chunk - 1) == stage:
                slots[(a.chunk - 1, a.mb)].output_grads = input_grads(slot)
        else:
            weight_grad.run_deferred(deferred.pop(key, []))
        times[a.kind.value] = times.get(a.kind.value, 0.0) + time.thread_time() - t
        times["faults " + a.kind.value] = (times.get("faults " + a.kind.value, 0)
                                           + resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - flt)
        times[(a.kind.value, a.chunk)] = times.get((a.kind.value, a.chunk), 0.0) + time.thread_time() - t


def step(built, times: dict) -> None:
    sched, mods, micro, n_embd = built
    for m in mods.values():
        m.zero_grad(set_to_none=True)
    for s in range(sched.pp):
        run_stage(sched, mods, micro, n_embd, s, times, sched.splits_backward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--schedules", default="1f1b,interleaved,zbv")
    ap.add_argument("--profile", default="", help="cProfile one step of this schedule after the rounds")
    ap.add_argument("--chunks", action="store_true", help="also CPU ms per (action kind, chunk)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from threefold.runtime.allocator import tune_malloc
    tune_malloc()   # as every rank does (runtime/launch.py)
    cfg = Config(pp=4)
    kinds = args.schedules.split(",")
    built = {k: build(cfg, k) for k in kinds}
    for k in kinds:   # warm-up
        step(built[k], {})
    rows = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            t = {}
            step(built[k], t)
            rows[k].append(t)
    print(f"pp=4, m=8, GPT 8 x 256, microbatch 2 x 128; {args.rounds} rounds; load {os.getloadavg()[0]:.1f}; "
          "CPU ms per step, all stages: median (best-worst)")
    base = statistics.median(sum(v for key, v in t.items() if key in ("F", "B", "W")) for t in rows[kinds[0]])
    for k in kinds:
        tot = [sum(v for key, v in t.items() if key in ("F", "B", "W")) * 1e3 for t in rows[k]]
        parts = "  ".join(f"{x} {statistics.median(t.get(x, 0) for t in rows[k]) * 1e3:7.1f}" for x in "FBW")
        parts += "  minor faults F/B/W " + "/".join(str(statistics.median(t.get("faults " + x, 0) for t in rows[k])) for x in "FBW")
        print(f"{k:12s} total {statistics.median(tot):7.1f} ({min(tot):7.1f}-{max(tot):7.1f})  x{statistics.median(tot) / base / 1e3:.3f}  {parts}")
        if args.chunks:
            keys = sorted(key for key in rows[k][0] if not isinstance(key, str))
            print("   " + "  ".join(f"{x}{c} {statistics.median(t[(x, c)] for t in rows[k]) * 1e3:.1f}" for x, c in keys))
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        step(built[args.profile], {})
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
