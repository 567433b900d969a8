"""threefold's ZeRO-3 (plan zero=3) against torch's FSDP2 (`fully_shard`), gloo CPU ranks.

The same model (examples/gpt.py, unmodified for threefold; for FSDP2 each transformer block
and then the root wrapped with `fully_shard`, torchtitan's layout, reshard after forward),
the same weights and global batch, AdamW, fp32, at dp=2 and dp=4. The two systems run in
alternating launched jobs (A B A B ...) in one process tree, so both see the same load.
Each job: set-up, warm-up steps, then timed steps (zero_grad + forward + backward + optimizer
step, a barrier before each); reported per job: the median step time and the peak resident
set during the timed steps (the high-water mark reset after warm-up, /proc/self/clear_refs;
the most of any rank, above that rank's resident set at the reset). The correctness gate:
threefold's losses equal one process's (rtol 1e-5); FSDP2's within 1e-4 of them.

    python bench/fsdp_vs_torch.py [--rounds 3] [--steps 10] [--n-embd 256] [--json]

Ratios are threefold / FSDP2 (goal <= 1.0 for both); the worst round is reported beside
the median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LR = 1e-2


def _kwargs(args) -> dict:
    return dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, seq=args.seq, batch=args.batch)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _reset_hwm() -> None:
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _timed(step, warmup: int, steps: int) -> tuple[list[float], float, list[float]]:
    losses = [step() for _ in range(warmup)]
    _reset_hwm()
    base = _rss_kb()
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    return times, (_hwm_kb() - base) / 1024, losses


def threefold_job(kwargs: dict, warmup: int, steps: int) -> dict:
    import threefold
    from tests.parity import load_workload
    torch.set_num_threads(1)
    w = load_workload("gpt", **kwargs)
    pm = threefold.parallelize(w["model"], f"dp={dist.get_world_size()},zero=3", w["inputs"], w["loss_fn"],
                               target=w["target"])
    del w["model"]
    opt = pm.optimizer(torch.optim.AdamW, lr=LR)

    def step():
        opt.zero_grad()
        loss = pm.step(*w["inputs"], target=w["target"])
        opt.step()
        return loss
    times, peak, losses = _timed(step, warmup, steps)
    return {"times": times, "peak_mb": peak, "losses": losses}


def fsdp2_job(kwargs: dict, warmup: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tests.parity import load_workload
    torch.set_num_threads(1)
    w = load_workload("gpt", **kwargs)
    model, n, r = w["model"], dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (n,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = w["inputs"][0].chunk(n)[r], w["target"].chunk(n)[r]

    def step():
        opt.zero_grad()
        loss = w["loss_fn"](model(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)          # the global batch's mean loss, like pm.step
        return float(total) / n
    times, peak, losses = _timed(step, warmup, steps)
    return {"times": times, "peak_mb": peak, "losses": losses}


def reference(kwargs: dict, n: int) -> list[float]:
    from tests.parity import adamw_losses, load_workload
    return adamw_losses(load_workload("gpt", **kwargs), n, LR)


def main(argv=None) -> int:
    from threefold.runtime.launch import launch
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dp", default="2,4")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    kwargs = _kwargs(args)
    ref = reference(kwargs, args.warmup + args.steps)
    report = {"model": kwargs, "load_start": os.getloadavg()[0], "setups": []}
    for dp in (int(x) for x in args.dp.split(",")):
        rounds = []
        for _ in range(args.rounds):
            ours = max((r for r in launch(threefold_job, dp, kwargs, args.warmup, args.steps, timeout=900)),
                       key=lambda r: r["peak_mb"])
            theirs = max((r for r in launch(fsdp2_job, dp, kwargs, args.warmup, args.steps, timeout=900)),
                         key=lambda r: r["peak_mb"])
            ok = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours["losses"], ref))
            close = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(theirs["losses"], ref))
            if not (ok and close):
                raise SystemExit(f"correctness gate failed at dp={dp}: threefold {ours['losses'][:3]}, "
                                 f"FSDP2 {theirs['losses'][:3]}, one process {ref[:3]}")
            t_ours, t_theirs = statistics.median(ours["times"]), statistics.median(theirs["times"])
            rounds.append({"threefold_s": t_ours, "fsdp2_s": t_theirs, "time_ratio": t_ours / t_theirs,
                           "threefold_peak_mb": ours["peak_mb"], "fsdp2_peak_mb": theirs["peak_mb"],
                           "memory_ratio": ours["peak_mb"] / max(theirs["peak_mb"], 1e-9)})
        setup = {"dp": dp, "rounds": rounds,
                 "time_ratio_median": statistics.median(r["time_ratio"] for r in rounds),
                 "time_ratio_worst": max(r["time_ratio"] for r in rounds),
                 "memory_ratio_median": statistics.median(r["memory_ratio"] for r in rounds),
                 "memory_ratio_worst": max(r["memory_ratio"] for r in rounds)}
        report["setups"].append(setup)
        if not args.json:
            print(f"dp={dp}: step time threefold/FSDP2 median {setup['time_ratio_median']:.3f} "
                  f"(worst {setup['time_ratio_worst']:.3f}); peak memory median "
                  f"{setup['memory_ratio_median']:.3f} (worst {setup['memory_ratio_worst']:.3f})")
            for r in rounds:
                print(f"   {r['threefold_s'] * 1e3:7.1f} ms vs {r['fsdp2_s'] * 1e3:7.1f} ms, "
                      f"{r['threefold_peak_mb']:6.1f} MB vs {r['fsdp2_peak_mb']:6.1f} MB")
    report["load_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"load average {report['load_start']:.1f} -> {report['load_end']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
