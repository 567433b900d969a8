"""compile=inductor against compile=none: tokens/s of the same plan, side by side in one job.

    python bench/compile_backend.py [--setups default,default-b64,llama512] [--plan pp=2,m=4]
                                    [--rounds 4] [--steps 5]

Each setup launches one job (2 ranks, 1 thread each, on this machine's 2 cores), builds the
model twice (one ParallelModule per compile mode, same plan and weights), pays warm-up (the
first steps: Inductor compiles there), then alternates timed blocks of `--steps` AdamW steps,
`--rounds` times per mode, so both modes see the same machine load. It prints each round's
tokens/s per mode, the ratio inductor/none per round, the ratio of the per-mode medians
(the figure: on a machine shared with bursty load one round can stall either mode), and
the worst round's ratio, and tokens per CPU-second of both ranks (median block), which
hardly moves with other jobs' load (a rank waiting on its peer sleeps).

The optimizer is built by `pm.optimizer`, so under compile=inductor it is torch's fused
AdamW (runtime/fused_optimizer.py) and under compile=none the foreach default: the ratio
covers the whole training step as `threefold train` runs it. For where the time goes, one
process: bench/compile_breakdown.py.

Setups:
  default      the main job's model (`threefold train`'s embedded GPT: 4 layers, h=64,
               4 heads, 256 byte tokens), batch 16 x seq 64 (threefold/configs/default.toml)
  default-b64  the same model with batch 64 (a larger batch: more work per op)
  llama512     a LLaMA-like model, h=512 (8 heads, 4 kv heads, SwiGLU 1376, RMSNorm, RoPE),
               4 layers, vocab 1024, batch 8 x seq 128 (examples/hf.py:llama)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from threefold.runtime.launch import launch  # noqa: E402

SETUPS = ("default", "default-b64", "llama512")


def build(setup: str):
    """(model, inputs, target, loss_fn) of a setup, seeded: the same weights on every call."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if setup.startswith("default"):
        from threefold.models.gpt import GPT, GPTConfig, lm_loss
        batch = 64 if setup == "default-b64" else 16
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64))
        idx = torch.randint(0, 256, (batch, 65), generator=g)
        return model, (idx[:, :-1],), idx[:, 1:], lm_loss
    if setup == "llama512":
        from examples.hf import llama
        w = llama(n_layer=4, hidden=512, n_head=8, n_kv_head=4, intermediate=1376, vocab_size=1024,
                  seq=128, batch=8)
        return w["model"], w["inputs"], w["target"], w["loss_fn"]
    raise SystemExit(f"unknown setup {setup!r}: choose from {', '.join(SETUPS)}")


def tokens_of(setup: str) -> int:
    return {"default": 16 * 64, "default-b64": 64 * 64, "llama512": 8 * 128}[setup]


def rank_job(setup: str, plan: str, rounds: int, steps: int) -> dict:
    import threefold
    torch.set_num_threads(1)
    pms = {}
    compile_s = {}
    for mode in ("none", "inductor"):
        model, inputs, target, loss_fn = build(setup)
        pm = threefold.parallelize(model, f"{plan},compile={mode}", inputs, loss_fn, target=target)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
        t0 = time.perf_counter()
        for _ in range(3):   # warm-up: Inductor compiles in the first step (Dynamo may once more)
            opt.zero_grad()
            pm.step(*inputs, target=target)
            opt.step()
        compile_s[mode] = time.perf_counter() - t0
        pms[mode] = (pm, opt, inputs, target)
    tokens = inputs[0].numel()
    rows = []
    for _ in range(rounds):
        row = {}
        for mode, (pm, opt, inputs, target) in pms.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                opt.zero_grad()
                loss = pm.step(*inputs, target=target)
                opt.step()
            row[mode] = tokens * steps / (time.perf_counter() - t0)
            row[f"cpu_{mode}"] = time.process_time() - c0   # this rank's CPU seconds (not waits)
            row[f"loss_{mode}"] = loss
        rows.append(row)
    return {"rows": rows, "warmup_s": compile_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--plan", default="pp=2,m=4", help="plan of both modes (2 ranks)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    worst_all = []
    for setup in args.setups.split(","):
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        ranks = launch(rank_job, 2, setup, args.plan, args.rounds, args.steps, threads=1, timeout=3600)
        wall = time.perf_counter() - t0
        r0 = ranks[0]
        print(f"== {setup}, plan {args.plan}: warm-up (3 steps) none {r0['warmup_s']['none']:.1f} s, "
              f"inductor {r0['warmup_s']['inductor']:.1f} s (compiles); job {wall:.0f} s, "
              f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
        ratios = []
        for i, row in enumerate(r0["rows"]):
            ratio = row["inductor"] / row["none"]
            ratios.append(ratio)
            print(f"  round {i}: none {row['none']:8.0f} tok/s   inductor {row['inductor']:8.0f} tok/s   "
                  f"ratio {ratio:.2f}   (losses {row['loss_none']:.5f} / {row['loss_inductor']:.5f})")
        # CPU seconds of both ranks per block: what the step costs, nearly blind to other
        # jobs' load (a rank waiting for its peer sleeps in gloo; wall time is not)
        cpu = {mode: sorted(sum(r["rows"][i][f"cpu_{mode}"] for r in ranks) for i in range(len(r0["rows"])))
               for mode in ("none", "inductor")}
        toks = args.steps * tokens_of(setup)
        cpu_med = {mode: toks / v[len(v) // 2] for mode, v in cpu.items()}
        print(f"  tokens per CPU-second (both ranks, median block): none {cpu_med['none']:.0f}, inductor "
              f"{cpu_med['inductor']:.0f}: ratio {cpu_med['inductor'] / cpu_med['none']:.2f}")
        ratios.sort()
        med = {mode: sorted(row[mode] for row in r0["rows"])[len(r0["rows"]) // 2] for mode in ("none", "inductor")}
        print(f"  median tok/s: none {med['none']:.0f}, inductor {med['inductor']:.0f}: "
              f"ratio of medians {med['inductor'] / med['none']:.2f}; per-round ratio worst {ratios[0]:.2f}, "
              f"median {ratios[len(ratios) // 2]:.2f}, best {ratios[-1]:.2f}")
        worst_all.append((setup, med["inductor"] / med["none"], ratios[0], cpu_med["inductor"] / cpu_med["none"]))
    print("inductor/none per setup: tokens/s ratio of medians (worst round), tokens per CPU-second: "
          + ", ".join(f"{s} {r:.2f} ({w:.2f}), cpu {c:.2f}" for s, r, w, c in worst_all))
    return 0


if __name__ == "__main__":
    sys.exit(main())
