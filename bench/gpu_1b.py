"""One GPU, a GPT of about 1B parameters, bf16 with recomputation (issue 12's GPU check).

    python bench/gpu_1b.py                  # on a CUDA machine: the 1B model, all contenders
    python bench/gpu_1b.py --smoke          # a tiny model on the CPU (what tests run here)

Contenders, interleaved step by step after warm-up (one optimizer step each, AdamW):
  * threefold: `parallelize(model, "dtype=bf16,recompute=<mode>")` (one rank, no parallelism:
    the compiled program, autocast, recomputation and the fused optimizer state as the
    runtime runs them), in up to three backends (issue 25): eager generated code
    (compile=none), the same with threefold's fused Triton kernels (fuse=true, GPU only), and
    each chunk through torch.compile/Inductor (compile=inductor; Triton on the GPU);
  * eager PyTorch: the same model under torch.autocast(bfloat16), fp32 master weights;
  * torch.compile of the eager step's model.
A contender that fails (a kernel that does not compile on this GPU, say) is reported as a
row with its one-line error; the others still run. Reported per contender: median step
time, tokens/s, MFU (model TFLOP/s over the GPU's dense bf16 peak: --peak-tflops, default
from the device name, e.g. 989 for H100/H200 SXM), model TFLOP/s (6 N per token for the
weights plus 12 L s h per token for attention scores and values, forward + backward; the
recomputed forward is not counted, as in Narayanan et al.'s "model FLOPs"), and
torch.cuda.max_memory_allocated beside threefold's memory estimate (planner/memory.py) for
the same plan. No GPU was lent in the session that wrote this: its figures are not in
BENCHMARKS.md yet.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from threefold.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

ONE_B = dict(n_layer=20, n_embd=2048, n_head=16, vocab_size=50304, seq=1024, batch=4)
SMOKE = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, seq=32, batch=2)


def build(cfg: dict, device: torch.device):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab_size"], block_size=cfg["seq"], n_layer=cfg["n_layer"],
                          n_head=cfg["n_head"], n_embd=cfg["n_embd"], dropout=0.0)).to(device)
    idx = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"] + 1),
                        generator=torch.Generator().manual_seed(1)).to(device)
    return model, idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def model_flops_per_step(cfg: dict, params: int) -> float:
    tokens = cfg["batch"] * cfg["seq"]
    return tokens * (6 * params + 12 * cfg["n_layer"] * cfg["seq"] * cfg["n_embd"])


# dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment, for MFU
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def peak_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def threefold_contender(cfg, device, recompute, backend: str = ""):
    import threefold
    from threefold.compiler.api import compile_workload
    from threefold.planner.memory import program_memory
    from threefold.workload import Workload
    model, x, y = build(cfg, device)
    plan = f"dtype=bf16,recompute={recompute}" + (f",{backend}" if backend else "")
    est = program_memory(compile_workload(Workload(model, (x,), y, lm_loss), plan))[0].to_json()
    pm = threefold.parallelize(model, plan, (x,), lm_loss, target=y, device=device)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = pm.step(x, target=y)   # a float: the step's mean loss
        opt.step()
        return loss
    return step, est


def eager_contender(cfg, device, compiled: bool):
    model, x, y = build(cfg, device)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(run(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def measure(contenders: dict, device, warmup: int, iters: int) -> dict:
    cuda = device.type == "cuda"
    times = {n: [] for n in contenders}
    peak, first_loss = {}, {}
    failed = {}
    for n, fn in list(contenders.items()):    # warm-up alone: compile, allocator, autotuning
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            for i in range(warmup):
                loss = fn()
                if i == 0:
                    first_loss[n] = loss   # the same weights and batch: equal up to bf16 rounding
        except Exception as exc:           # one contender failing must not cost the whole check
            failed[n] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            del contenders[n], times[n]
            continue
        if cuda:
            torch.cuda.synchronize(device)
            peak[n] = torch.cuda.max_memory_allocated(device)
    names = list(contenders)
    for it in range(iters):
        for n in names[it % len(names):] + names[:it % len(names)]:
            if cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            contenders[n]()
            if cuda:
                torch.cuda.synchronize(device)
            times[n].append(time.perf_counter() - t)
    rows = {n: {"step_s": statistics.median(v), "max_memory_allocated": peak.get(n), "first_loss": first_loss[n]}
            for n, v in times.items()}
    return rows, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (no GPU needed)")
    ap.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile (of eager and threefold's)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak for MFU (default: by device name, e.g. 989 for H100/H200)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_1b: no CUDA device here; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    cfg = SMOKE if args.smoke else ONE_B
    step, est = threefold_contender(cfg, device, args.recompute)
    contenders = {f"threefold recompute={args.recompute}": step}
    if not args.smoke:   # threefold's Triton kernels need a GPU (the CPU runs them only interpreted)
        contenders[f"threefold recompute={args.recompute},fuse=true"] = \
            threefold_contender(cfg, device, args.recompute, "fuse=true")[0]
    if not args.no_compile:   # Inductor: C++ on the smoke run's CPU, Triton on the GPU
        contenders[f"threefold recompute={args.recompute},compile=inductor"] = \
            threefold_contender(cfg, device, args.recompute, "compile=inductor")[0]
    contenders["eager autocast bf16"] = eager_contender(cfg, device, compiled=False)
    if not args.no_compile and not args.smoke:
        contenders["torch.compile autocast bf16"] = eager_contender(cfg, device, compiled=True)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(GPTConfig(vocab_size=cfg["vocab_size"], block_size=cfg["seq"],
                                                      n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                                                      n_embd=cfg["n_embd"])).parameters())
    flops = model_flops_per_step(cfg, params)
    rows, failed = measure(contenders, device, args.warmup if not args.smoke else 1,
                           args.iters if not args.smoke else 2)
    tokens = cfg["batch"] * cfg["seq"]
    peak = args.peak_tflops or peak_tflops(device)
    for r in rows.values():
        r["tokens_per_s"] = tokens / r["step_s"]
        r["model_tflops"] = flops / r["step_s"] / 1e12
        r["mfu"] = r["model_tflops"] / peak if peak else None
    out = {"config": cfg, "params": params, "device": str(device), "estimate_bytes": est, "rows": rows,
           "failed": failed, "peak_tflops": peak}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"GPT {params / 1e6:.1f}M params, {cfg}, {device}")
    print(f"threefold estimate: {est['total'] / 2**30:.2f} GiB (params {est['params'] / 2**30:.2f}, grads "
          f"{est['grads'] / 2**30:.2f}, optimizer {est['optimizer'] / 2**30:.2f}, activations "
          f"{est['activations'] / 2**30:.2f})")
    print(f"{'contender':<52} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'max alloc GiB':>14} "
          f"{'/estimate':>9} {'loss 1':>8}")
    for n, r in rows.items():
        alloc = r["max_memory_allocated"]
        shown = f"{alloc / 2**30:14.2f} {alloc / est['total']:9.3f}" if alloc else f"{'-':>14} {'-':>9}"
        mfu = f"{r['mfu']:6.1%}" if r["mfu"] is not None else f"{'-':>6}"
        print(f"{n:<52} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:10.0f} {r['model_tflops']:8.2f} {mfu} {shown} "
              f"{r['first_loss']:8.4f}")
    for n, why in failed.items():
        print(f"{n:<52} failed: {why}")
    base = rows.get(f"threefold recompute={args.recompute}")
    for n, r in rows.items():
        if base is not None and n != f"threefold recompute={args.recompute}":
            print(f"ratio tokens/s {n} / threefold eager: {r['tokens_per_s'] / base['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
