"""threefold.load with the restricted reader (checkpoint/safe_read.py) against plain DCP reading.

One GPT (examples/gpt.py, about 90 MB of fp32 parameters by default) in one process
(tp=1), after one AdamW step, saved once. Then, alternating, median of --reps:

  * safe: threefold.load as shipped: `.metadata` through the restricted unpickler,
    non-tensor entries with torch.load(weights_only=True);
  * plain: the same threefold.load with DCP's own reader (pickle.load of `.metadata`) and
    DCP's default `load_bytes` (torch.load(weights_only=False)), i.e. the code before;
  * metadata alone: reading `.metadata` with each (the only read that changed in kind).

    python bench/checkpoint_safe_reader.py [--n-layer 6] [--n-embd 512] [--reps 7] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import threefold
    import threefold.checkpoint.load as load_mod
    import threefold.checkpoint.planners as planners
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from examples.gpt import workload
    from threefold.checkpoint.safe_read import SafeReader, read_metadata_file
    w = workload(n_layer=args.n_layer, n_embd=args.n_embd, n_head=8, vocab_size=4096, seq=16, batch=4)
    pm = threefold.parallelize(w["model"], "tp=1", w["inputs"], w["loss_fn"], target=w["target"])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.step(*w["inputs"], target=w["target"])
    opt.step()
    safe_bytes = planners.LoadShards.load_bytes
    with tempfile.TemporaryDirectory() as root:
        path = threefold.save(pm, opt, root)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))

        def timed(kind: str) -> float:
            load_mod.SafeReader = SafeReader if kind == "safe" else FileSystemReader
            planners.LoadShards.load_bytes = safe_bytes if kind == "safe" else DefaultLoadPlanner.load_bytes
            start, cpu = time.perf_counter(), time.process_time()
            threefold.load(pm, opt, path)
            times["cpu_" + kind].append(time.process_time() - cpu)
            return time.perf_counter() - start

        def timed_md(kind: str) -> float:
            start = time.perf_counter()
            if kind == "safe":
                read_metadata_file(os.path.join(path, ".metadata"))
            else:
                with open(os.path.join(path, ".metadata"), "rb") as f:
                    pickle.load(f)
            return time.perf_counter() - start

        times = {"safe": [], "plain": [], "md_safe": [], "md_plain": [], "cpu_safe": [], "cpu_plain": []}
        timed("safe")           # warm the page cache and imports
        times["cpu_safe"].clear()
        for rep in range(args.reps):
            for kind in (("plain", "safe") if rep % 2 else ("safe", "plain")):   # neither always first
                times[kind].append(timed(kind))
                for _ in range(20):
                    times["md_" + kind].append(timed_md(kind))
        load_mod.SafeReader = SafeReader
        planners.LoadShards.load_bytes = safe_bytes
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"bytes": size, "params": sum(p.numel() for p in pm.engine.params.values()),
           "load_safe_s": med["safe"], "load_plain_s": med["plain"], "ratio": med["safe"] / med["plain"],
           "paired_ratio": statistics.median(a / b for a, b in zip(times["safe"], times["plain"])),
           "cpu_safe_s": med["cpu_safe"], "cpu_plain_s": med["cpu_plain"], "cpu_ratio": med["cpu_safe"] / med["cpu_plain"],
           "metadata_safe_ms": 1e3 * med["md_safe"], "metadata_plain_ms": 1e3 * med["md_plain"],
           "metadata_ratio": med["md_safe"] / med["md_plain"], "reps": args.reps}
    if os.environ.get("BENCH_VERBOSE"):
        print({k: [round(x, 3) for x in v] for k, v in times.items() if not k.startswith("md_")})
    if args.json:
        print(json.dumps(out))
    else:
        print(f"checkpoint {size / 1e6:.1f} MB ({out['params'] / 1e6:.1f} M params + AdamW), median of {args.reps}:")
        print(f"  threefold.load  safe {med['safe']:.3f} s  plain {med['plain']:.3f} s  ratio {out['ratio']:.3f}x "
              f"(paired {out['paired_ratio']:.3f}x); CPU time safe {med['cpu_safe']:.3f} s  plain "
              f"{med['cpu_plain']:.3f} s  ratio {out['cpu_ratio']:.3f}x")
        print(f"  .metadata only  safe {out['metadata_safe_ms']:.2f} ms  plain {out['metadata_plain_ms']:.2f} ms  "
              f"ratio {out['metadata_ratio']:.3f}x")


if __name__ == "__main__":
    main()
