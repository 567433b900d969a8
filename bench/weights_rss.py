"""Peak RSS per rank when starting a model from safetensors with parallelize(weights=PATH).

The parent builds a GPT (threefold/models/gpt.py) of about --gb GB of fp32 parameters once,
writes it as one safetensors file and frees it. Then each rank of --plan (default
tp=2,pp=2) records its RSS after `import torch, threefold` (the baseline), builds the same
model under checkpoint.weights.empty_weights() (parameters on meta, buffers real), calls
parallelize(..., weights=PATH) and records its peak RSS (VmHWM). Reported per rank:
(peak - baseline) / model size; the goal is at most 0.35 under tp=2,pp=2. Building the
model on a real device instead costs every rank 1x or more by construction.

    python bench/weights_rss.py [--gb 2] [--plan tp=2,pp=2] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """This process image's high-water RSS (VmHWM). Not ru_maxrss: that survives the
    spawn's fork+exec, so it would report the launcher's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _cfg(gb: float):
    from threefold.models.gpt import GPTConfig
    n_embd = 2048
    n_layer = max(2, round(gb * 2**30 / 4 / (12 * n_embd * n_embd)))
    return GPTConfig(vocab_size=8192, block_size=64, n_layer=n_layer, n_head=16, n_embd=n_embd)


def _rank(cfg, path, plan):
    import torch
    import threefold
    from threefold.checkpoint.weights import empty_weights
    from threefold.models.gpt import GPT, lm_loss
    torch.set_num_threads(1)
    base = _rss_now()
    import threefold.api  # noqa: F401  (the compiler's imports: counted apart from the model)
    imported = _rss_now()
    with empty_weights():
        model = GPT(cfg)
    built = _rss_now()
    idx = torch.randint(0, cfg.vocab_size, (4, 18))   # seq 17: only dim 0 divides by m
    pm = threefold.parallelize(model, plan, (idx[:, :-1],), lm_loss, target=idx[:, 1:], weights=path)
    local = sum(p.numel() * p.element_size() for p in pm.engine.params.values())
    peak = _peak()
    return {"baseline": base, "imported": imported, "built": built, "peak": peak, "local_param_bytes": local}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--plan", default="tp=2,pp=2,m=2")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file
    from threefold.models.gpt import GPT
    from threefold.plan import Plan
    from threefold.runtime.launch import launch
    cfg = _cfg(args.gb)
    tmp = tempfile.mkdtemp(prefix="threefold-rss-")
    try:
        path = os.path.join(tmp, "model.safetensors")
        torch.manual_seed(0)
        model = GPT(cfg)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, path)
        del model
        results = launch(_rank, Plan.parse(args.plan).world_size, cfg, path, args.plan, timeout=1800)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [{"rank": r, "baseline_mb": x["baseline"] / 2**20, "imported_mb": x["imported"] / 2**20,
             "built_mb": x["built"] / 2**20, "peak_mb": x["peak"] / 2**20,
             "local_params_mb": x["local_param_bytes"] / 2**20,
             "over_baseline_x_model": (x["peak"] - x["baseline"]) / size} for r, x in enumerate(results)]
    out = {"plan": args.plan, "model_mb": size / 2**20, "n_layer": cfg.n_layer, "ranks": rows,
           "worst_x_model": max(r["over_baseline_x_model"] for r in rows)}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"GPT {out['model_mb']:.0f} MB fp32 ({cfg.n_layer} layers, h={cfg.n_embd}), plan {args.plan}, weights= safetensors")
    print(f"{'rank':>4}{'baseline MB':>13}{'+api MB':>9}{'+meta model':>12}{'peak MB':>10}{'params MB':>11}"
          f"{'(peak-base)/model':>19}")
    for r in rows:
        print(f"{r['rank']:>4}{r['baseline_mb']:13.0f}{r['imported_mb']:9.0f}{r['built_mb']:12.0f}{r['peak_mb']:10.0f}"
              f"{r['local_params_mb']:11.0f}"
              f"{r['over_baseline_x_model']:19.3f}")
    print(f"worst rank: {out['worst_x_model']:.3f}x the model over its baseline (goal <= 0.35)")


if __name__ == "__main__":
    main()
