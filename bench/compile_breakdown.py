"""Where a step's CPU time goes, compile=none vs compile=inductor: one process, one thread.

    python bench/compile_breakdown.py [--setups default,llama512] [--plan m=4] [--steps 5] [--rounds 5]

For each setup and mode: CPU ms per step (both modes in one process, timed in alternating
blocks: the median block, no profiler), the optimizer step's time, then one profiled block
of pm.step split into BLAS (aten mm / addmm / bmm called as ops), the compiled graphs (the
"## Call CompiledFxGraph" events' self time: Inductor's generated kernels, and with the C++
wrapper also the BLAS calls it makes, which then bypass the profiler), other aten ops
(eager's op-by-op kernels, copies, the engine's own tensor work) and the rest (Python: the
engine, autograd, Dynamo's guards), each as its share of the profiled block's wall time
times the unprofiled CPU step. The last line is the bound of any compiler that keeps
eager's BLAS calls (Inductor on CPU calls the same extern matmuls): eager step / eager BLAS.
Setups are bench/compile_backend.py's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.compile_backend import build  # noqa: E402

BLAS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


def build_mode(setup: str, plan: str, mode: str):
    import threefold
    model, inputs, target, loss_fn = build(setup)
    pm = threefold.parallelize(model, f"{plan},compile={mode}", inputs, loss_fn, target=target)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    return pm, opt, inputs, target


def block(run, n: int) -> tuple[float, float]:
    """CPU seconds per step of n steps: (forward+backward, optimizer step)."""
    pm, opt, inputs, target = run
    step_s = opt_s = 0.0
    for _ in range(n):
        opt.zero_grad()
        c0 = time.process_time()
        pm.step(*inputs, target=target)
        c1 = time.process_time()
        opt.step()
        step_s += c1 - c0
        opt_s += time.process_time() - c1
    return step_s / n, opt_s / n


def split(run, steps: int, step_s: float) -> dict:
    """The profiled parts of pm.step, in CPU seconds per step."""
    from torch.profiler import profile
    pm, opt, inputs, target = run
    with profile() as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            pm.step(*inputs, target=target)
        wall = time.perf_counter() - t0
    # the profiler's times are wall clock (a process other jobs preempt is charged for the
    # wait, and the profiler adds its own cost): each part's share of the profiled block's
    # wall time, applied to the unprofiled CPU step
    parts = {"blas": 0.0, "compiled graphs": 0.0, "other aten": 0.0}
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6 / wall * step_s
        if e.key in BLAS:
            parts["blas"] += s
        elif e.key.startswith("## Call CompiledFxGraph"):
            parts["compiled graphs"] += s
        elif e.key.startswith("aten::") or e.key.startswith("graph_"):
            parts["other aten"] += s
    parts["python and the rest"] = max(step_s - sum(parts.values()), 0.0)
    return parts


def measure(setup: str, plan: str, steps: int, rounds: int) -> dict:
    """Both modes built in one process, warmed up (Inductor compiles), then timed in
    alternating blocks (the same machine load for both); the median block of each."""
    runs = {mode: build_mode(setup, plan, mode) for mode in ("none", "inductor")}
    for run in runs.values():
        block(run, 3)
    blocks = {mode: [] for mode in runs}
    for _ in range(rounds):
        for mode, run in runs.items():
            blocks[mode].append(block(run, steps))
    out = {}
    for mode, run in runs.items():
        step_s, opt_s = sorted(blocks[mode])[rounds // 2]
        out[mode] = {"step_s": step_s, "opt_s": opt_s, "parts": split(run, steps, step_s)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="default,llama512")
    ap.add_argument("--plan", default="m=4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from threefold.runtime.allocator import tune_malloc
    tune_malloc()   # as each launched rank does
    for setup in args.setups.split(","):
        res = measure(setup, args.plan, args.steps, args.rounds)
        print(f"== {setup}, plan {args.plan}, 1 thread (CPU ms per step; forward+backward, then optimizer)")
        for mode, r in res.items():
            parts = ", ".join(f"{k} {v * 1e3:.1f} ({v / r['step_s']:.0%})" for k, v in r["parts"].items())
            print(f"  {mode:8s} step {r['step_s'] * 1e3:7.1f} + optimizer {r['opt_s'] * 1e3:6.2f} = "
                  f"{(r['step_s'] + r['opt_s']) * 1e3:7.1f}: {parts}")
        n, i = res["none"], res["inductor"]
        total = {m: r["step_s"] + r["opt_s"] for m, r in res.items()}
        print(f"  inductor/none: {total['none'] / total['inductor']:.2f}x (step alone "
              f"{n['step_s'] / i['step_s']:.2f}x); bound with eager's BLAS kept: "
              f"{total['none'] / n['parts']['blas']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
