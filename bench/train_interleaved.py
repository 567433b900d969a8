"""threefold's training step against plain PyTorch loops, in alternating blocks of one run.

    python bench/train_interleaved.py [--plan dp=2,m=1,compile=inductor] [--blocks 8] [--steps 20]
        [--batch 16] [--seq 64] [--n-layer 4] [--n-embd 64] [--n-head 4] [--no-gloo]

Why interleaved: on this 2-core VM the loop on 2 threads swings 25k-38k tokens/s from run to
run, and other jobs come and go; back-to-back runs compare different machines. Here every
side runs `--steps` steps, then the next side, `--blocks` times round, and while one side
runs the others sleep (the loop in this process; threefold's ranks on a multiprocessing
Event), so each block of each side saw about the same machine. Reported per side: tokens/s
over all its blocks (each step timed alone, as `threefold train` times them, data excluded),
threefold / peer per block (median and worst), and the ratio at each side's 10th-percentile
step (its steps that nothing else on the machine slowed: the quiet machine's figure).

Sides (the same GPT, data and batch; every side's warm-up, compiles included, done first):
  * eager:      the model as is, torch's default threads (all cores), AdamW's default
                (for-each loop over parameters on CPU), clip_grad_norm_'s default;
  * compiled:   torch.compile(model), default threads, AdamW's default (bench/train_vs_eager.py
                --compiled's peer);
  * compiled+fused: torch.compile(model), default threads, fused AdamW and for-each clipping:
                the optimizer threefold train uses, so only the parallel step differs;
  * threefold:  --plan on its ranks (1 thread each), `threefold train`'s step: zero_grad,
                pm.step, pm.clip_grad_norm_, AdamW built as threefold train builds it (fused);
  * threefold (gloo): the same with THREEFOLD_LOCAL_REDUCE=0: the gradients all-reduced by
                gloo, not summed through shared memory (runtime/local_reduce.py); --no-gloo
                leaves it out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from threefold.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

LR, CLIP = 1e-3, 1.0


def _model(a) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=a.seq, n_layer=a.n_layer, n_head=a.n_head,
                         n_embd=a.n_embd, dropout=0.0))


def _batches(a, n: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (a.batch, a.seq), generator=g),
             torch.randint(0, 256, (a.batch, a.seq), generator=g)) for _ in range(n)]


def loop_side(a, compiled: bool, fused: bool):
    """A plain loop's step function (one call: one timed step)."""
    model = _model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True if fused else None)
    forward = torch.compile(model) if compiled else model
    data, i = _batches(a), [0]

    def step() -> float:
        x, y = data[i[0] % len(data)]
        i[0] += 1
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = lm_loss(forward(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True if fused else None)
        opt.step()
        loss.item()
        return time.perf_counter() - t0
    return step


def rank_side(a, plan: str, go, done, warmup: int, blocks: int, steps: int) -> list[float]:
    """On each rank: threefold train's step, `steps` at a time when the parent says go."""
    import torch.distributed as dist
    import threefold
    from threefold.train.optim import adamw
    data = _batches(a)
    pm = threefold.parallelize(_model(a), plan, (data[0][0],), lm_loss, target=data[0][1])
    opt = adamw(pm, LR, 0.1)

    def step(k: int) -> float:
        x, y = data[k % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        pm.step(x, target=y)
        pm.clip_grad_norm_(CLIP)
        opt.step()
        return time.perf_counter() - t0
    seconds = []
    for b in range(-1, blocks):
        go.wait()
        dist.barrier()
        if dist.get_rank() == 0:
            go.clear()
        times = [step(k) for k in range(warmup if b < 0 else steps)]
        if b >= 0:
            seconds.extend(times)
        dist.barrier()
        if dist.get_rank() == 0:
            done.set()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="dp=2,m=1,compile=inductor")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per block and side")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--no-gloo", action="store_true", help="leave out threefold with THREEFOLD_LOCAL_REDUCE=0")
    a = p.parse_args()
    from threefold.runtime.launch import launch
    world = threefold_world(a.plan)
    ctx = mp.get_context("spawn")
    sides = {"eager": loop_side(a, False, False), "compiled": loop_side(a, True, False),
             "compiled+fused": loop_side(a, True, True)}
    ranks: dict[str, tuple] = {}
    variants = [("threefold", "1")] + ([] if a.no_gloo else [("threefold (gloo)", "0")])
    for name, env in variants:
        go, done, out = ctx.Event(), ctx.Event(), {}
        os.environ["THREEFOLD_LOCAL_REDUCE"] = env     # read by the ranks at set-up (spawned now)

        def run(go=go, out=out):
            out["result"] = launch(rank_side, world, a, a.plan, go, done, a.warmup, a.blocks, a.steps,
                                   timeout=3600)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        ranks[name] = (go, done, out, t)
        time.sleep(2)        # the ranks copied the environment at spawn
    os.environ.pop("THREEFOLD_LOCAL_REDUCE", None)
    per_block: dict[str, list[float]] = {n: [] for n in list(sides) + list(ranks)}
    steps_of: dict[str, list[float]] = {n: [] for n in list(sides) + list(ranks)}
    tokens = a.batch * a.seq
    print(f"plan {a.plan}, {a.blocks} blocks x {a.steps} steps per side, batch {a.batch} x {a.seq}, "
          f"GPT {a.n_layer}x{a.n_embd}; {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    for b in range(-1, a.blocks):
        for name, fn in sides.items():
            times = [fn() for _ in range(a.warmup if b < 0 else a.steps)]
            if b >= 0:
                per_block[name].append(tokens * len(times) / sum(times))
                steps_of[name].extend(times)
        for name, (go, done, out, t) in ranks.items():
            go.set()
            while not done.wait(1.0):
                if not t.is_alive():
                    raise SystemExit(f"{name}: ranks stopped: {out}")
            done.clear()
        if b >= 0:
            print(f"block {b}: " + ", ".join(f"{n} {per_block[n][-1]:,.0f}" for n in sides)
                  + f" tokens/s (threefold's at the end); load {os.getloadavg()[0]:.1f}", flush=True)
    for name, (go, done, out, t) in ranks.items():
        t.join()
        secs = out["result"][0]      # rank 0's steps (threefold train reports rank 0's)
        per_block[name] = [tokens * a.steps / sum(secs[i:i + a.steps]) for i in range(0, len(secs), a.steps)]
        steps_of[name] = secs
    # the quiet moments: a step that nothing else on the machine slowed is one of the fast
    # ones, whichever side it is (10th percentile of all its steps)
    quiet = {n: tokens / sorted(v)[len(v) // 10] for n, v in steps_of.items()}
    print("tokens/s (median over blocks; min-max; at the 10th-percentile step):")
    for n, v in per_block.items():
        print(f"  {n:18s} {statistics.median(v):9,.0f}  ({min(v):,.0f}-{max(v):,.0f}; p10 step {quiet[n]:,.0f})")
    for tf in ranks:
        for peer in sides:
            r = sorted(x / y for x, y in zip(per_block[tf], per_block[peer]))
            print(f"ratio {tf} / {peer}: per block median {statistics.median(r):.3f}, worst {r[0]:.3f}; "
                  f"overall {statistics.median(per_block[tf]) / statistics.median(per_block[peer]):.3f}; "
                  f"p10 steps {quiet[tf] / quiet[peer]:.3f}")


def threefold_world(plan: str) -> int:
    from threefold import Plan
    return Plan.parse(plan).world_size


if __name__ == "__main__":
    main()
