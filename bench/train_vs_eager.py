"""The main job against a plain PyTorch loop: same model, data, optimizer and schedule.

    python bench/train_vs_eager.py [train flags...] [--threads 1,2] [--compiled] [--compiled-fused] [--fused-adamw] [--skip-threefold]

Runs (1) a single-process eager loop written with nothing but torch (AdamW with decay on
Linear matrices only, linear warmup + cosine, global-norm clipping, the same validation
batches) over threefold.dataset's batches, once per thread count in --threads (default:
1 thread, and torch's default, which is every core it sees: the fair peer of a job whose
ranks use all the cores), then (2) `threefold train --json` with the same settings, and
prints tokens/s of each, threefold's ratio to each eager run (the worst last), the train
and validation losses at the start and the end, and the load average around each run.
Settings are threefold's (embedded defaults < --config < flags). --compiled adds the same
loop with the model under torch.compile (Inductor, torch's default threads; the first
step, which compiles, is left out of tokens/s as every run's first step is). The loop's AdamW
is torch's default (a loop over parameters on CPU); threefold train's is fused (one kernel):
--fused-adamw adds the loop with fused AdamW too, so the optimizer's share of a ratio shows;
--compiled-fused the torch.compile'd loop with fused AdamW and for-each clipping (threefold
train's optimizer and clip: only the parallel step differs). The runs here are back to back;
bench/train_interleaved.py alternates the sides in blocks of one run (a fairer ratio on a
machine whose load changes).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from threefold.config import add_arguments, from_args  # noqa: E402
from threefold.dataset import load_data  # noqa: E402
from threefold.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402


def lr_at(step: int, cfg) -> float:
    """Linear warmup to cfg.lr, then cosine to cfg.min_lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / (cfg.warmup + 1)
    span = cfg.steps - 1 - cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / span) if span > 0 else 0.0
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def val_loss(model, batches) -> float:
    model.eval()
    out = sum(lm_loss(model(x), y).item() for x, y in batches) / len(batches)
    model.train()
    return out


def eager(cfg, compiled: bool = False, fused: bool = False) -> dict:
    data = load_data(cfg)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=cfg.seq, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) not in tables]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
                            fused=fused or None)
    sampler, vals = data.sampler(cfg), data.val_batches(cfg)
    forward = torch.compile(model) if compiled else model   # validation stays eager (no recompile)
    losses, evals, seconds = [], [], []
    evals.append((0, val_loss(model, vals)))
    for step in range(cfg.steps):
        x, y = sampler.next()
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad()
        loss = lm_loss(forward(x), y)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip,
                                           foreach=True if fused and compiled else None)
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            evals.append((step + 1, val_loss(model, vals)))
    steady = seconds[1:] or seconds
    return {"tokens_per_second": cfg.batch * cfg.seq * len(steady) / sum(steady), "seconds": sum(seconds),
            "first_loss": losses[0], "final_loss": losses[-1], "val": evals,
            "params": sum(p.numel() for p in model.parameters())}


def threefold_train(argv: list[str]) -> tuple[dict, float]:
    out = tempfile.mkdtemp(prefix="tf-bench-")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "threefold", "train", *argv, "--json", "--force",
                           "--out", os.path.join(out, "run")], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"threefold train failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, skip=("spec", "out", "json", "force"))
    default_threads = torch.get_num_threads()     # torch's default: the cores it sees
    p.add_argument("--threads", default=f"1,{default_threads}",
                   help=f"comma-separated torch thread counts of the eager loop (default 1,{default_threads}: "
                   "one thread, and torch's default)")
    p.add_argument("--skip-threefold", action="store_true", help="run the eager loop only")
    p.add_argument("--compiled", action="store_true", help="also the loop under torch.compile, default threads")
    p.add_argument("--fused-adamw", action="store_true", help="also the loop with fused AdamW, default threads")
    p.add_argument("--compiled-fused", action="store_true",
                   help="also the loop under torch.compile with fused AdamW and for-each clipping, default threads")
    args = p.parse_args()
    cfg = from_args(args)
    threads = sorted({int(n) for n in str(args.threads).split(",") if n.strip()})
    print(f"settings: plan {cfg.plan}, {cfg.steps} steps, batch {cfg.batch} x seq {cfg.seq}, "
          f"GPT {cfg.n_layer}x{cfg.n_embd} ({cfg.n_head} heads), lr {cfg.lr}, data {cfg.data or 'embedded'}; "
          f"{os.cpu_count()} cores, {_load()}")
    eagers = {}
    runs = [(n, False, False) for n in threads] + ([(default_threads, True, False)] if args.compiled else []) + (
        [(default_threads, False, True)] if args.fused_adamw else []) + (
        [(default_threads, True, True)] if args.compiled_fused else [])
    for n, compiled, fused in runs:
        torch.set_num_threads(n)
        before = _load()
        name = f"{n} thread{'s' if n > 1 else ''}" + (", torch.compile" if compiled else "") + (
            ", fused AdamW" + (", for-each clip" if compiled else "") if fused else "")
        e = eagers[name] = eager(cfg, compiled, fused)
        print(f"eager ({name}, {e['params']:,} params): {e['tokens_per_second']:,.0f} "
              f"tokens/s, {e['seconds']:.1f} s of steps; loss {e['first_loss']:.4f} -> {e['final_loss']:.4f}; "
              f"val {e['val'][0][1]:.4f} -> {e['val'][-1][1]:.4f} (step {e['val'][-1][0]}); {before} -> {_load()}")
    if args.skip_threefold:
        return
    passthrough = [a for a in sys.argv[1:] if a not in ("--skip-threefold", "--compiled", "--fused-adamw",
                                                         "--compiled-fused")]
    for flag in [a for a in passthrough if a.startswith("--threads")]:
        i = passthrough.index(flag)
        del passthrough[i:i + (1 if "=" in flag else 2)]
    before = _load()
    t, wall = threefold_train(passthrough)
    val_text = ""
    if t.get("first_val_loss") is not None:
        val_text = f"; val {t['first_val_loss']:.4f} -> {t['final_val_loss']:.4f}"
    print(f"threefold train ({cfg.plan}): {t['tokens_per_second']:,.0f} tokens/s, wall {wall:.1f} s "
          f"({t['seconds']:.1f} s of steps); loss {t['first_loss']:.4f} -> {t['final_loss']:.4f}{val_text}; "
          f"{before} -> {_load()}")
    ratios = {n: t["tokens_per_second"] / e["tokens_per_second"] for n, e in eagers.items()}
    for n, r in sorted(ratios.items(), key=lambda kv: -kv[1]):     # the worst (the fair peer) last
        print(f"ratio threefold/eager({n}) tokens/s: {r:.2f}")


if __name__ == "__main__":
    main()
