"""Where a step's CPU time goes, compile=none vs compile=inductor: one process, one thread.

    python bench/compile_breakdown.py [--setups default,llama512] [--plan m=4] [--steps 5]

For each setup and mode: CPU ms per step (median of 3 blocks, no profiler), the optimizer
step's time, then one profiled block of pm.step split into BLAS (aten mm / addmm / bmm
called as ops), the compiled graphs (the "## Call CompiledFxGraph" events' self time:
Inductor's generated kernels, and with the C++ wrapper also the BLAS calls it makes, which
then bypass the profiler), other aten ops (eager's op-by-op kernels, copies, the engine's
own tensor work) and the rest (Python: the engine, autograd, Dynamo's guards; against the
unprofiled step). The last line is the bound of any compiler that keeps eager's BLAS calls
(Inductor on CPU calls the same extern matmuls): eager step / eager BLAS time.
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


def measure(setup: str, plan: str, mode: str, steps: int) -> dict:
    import threefold
    model, inputs, target, loss_fn = build(setup)
    pm = threefold.parallelize(model, f"{plan},compile={mode}", inputs, loss_fn, target=target)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)

    def block(n):
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
    block(3)   # warm-up: Inductor compiles here
    blocks = sorted(block(steps) for _ in range(3))
    step_s, opt_s = blocks[1]
    from torch.profiler import profile
    with profile() as prof:
        for _ in range(steps):
            opt.zero_grad()
            pm.step(*inputs, target=target)
    split = {"blas": 0.0, "compiled graphs": 0.0, "other aten": 0.0}
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6 / steps
        if e.key in BLAS:
            split["blas"] += s
        elif e.key.startswith("## Call CompiledFxGraph"):
            split["compiled graphs"] += s
        elif e.key.startswith("aten::") or e.key.startswith("graph_"):
            split["other aten"] += s
    # the rest against the unprofiled step (the profiler's own cost lands in the small ops)
    split["python and the rest"] = max(step_s - sum(split.values()), 0.0)
    return {"step_s": step_s, "opt_s": opt_s, "parts": split}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="default,llama512")
    ap.add_argument("--plan", default="m=4")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from threefold.runtime.allocator import tune_malloc
    tune_malloc()   # as each launched rank does
    for setup in args.setups.split(","):
        res = {mode: measure(setup, args.plan, mode, args.steps) for mode in ("none", "inductor")}
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
