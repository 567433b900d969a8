"""threefold.save/load against torch.distributed.checkpoint used directly and torch.save.

One GPT (examples/gpt.py, about 90 MB of fp32 parameters by default) under tp=2 (or
--plan) on local gloo ranks, after one AdamW step (so the optimizer holds two moments per
parameter: about 3x the parameter bytes in all). Timed, median of --reps, alternating:

  * threefold.save / threefold.load: our layout pieces through DCP, plus the per-file CRC32,
    threefold.json, the atomic rename and (at load) the checks before any byte is read;
  * DCP directly on the same state (the same pieces and planners, a plain FileSystemWriter
    and dcp.load, nothing else): what our wrapping costs on top of DCP;
  * torch.save / torch.load of the full (unsharded) model and AdamW state in one process,
    the way a single-process job checkpoints (timed in the parent, one thread).

Bytes are what lands on disk. A barrier brackets every timed call on the ranks.

    python bench/checkpoint_vs_dcp.py [--plan tp=2] [--n-layer 6] [--n-embd 512] [--reps 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _workload(args):
    from examples.gpt import workload
    return workload(n_layer=args.n_layer, n_embd=args.n_embd, n_head=8, vocab_size=args.vocab,
                    seq=16, batch=4)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _timed(fn):
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _rank(args, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import threefold
    from threefold.checkpoint.planners import LoadShards, SaveShards
    from threefold.checkpoint.save import _collect
    torch.set_num_threads(1)
    w = _workload(args)
    pm = threefold.parallelize(w["model"], args.plan, w["inputs"], w["loss_fn"], target=w["target"])
    del w["model"]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt.zero_grad()
    pm.step(*w["inputs"], target=w["target"])
    opt.step()
    rank = dist.get_rank()
    times = {k: [] for k in ("threefold_save", "dcp_save", "threefold_load", "dcp_load")}
    sizes = {}
    for rep in range(args.reps):
        ours = os.path.join(root, "threefold")
        direct = os.path.join(root, f"dcp{rep}")
        t, path = _timed(lambda: threefold.save(pm, opt, ours, step=rep, keep=1))
        times["threefold_save"].append(t)
        sd = _collect(pm, opt, rep, None, rank)
        t, _ = _timed(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(direct, thread_count=1),
                                       planner=SaveShards()))
        times["dcp_save"].append(t)
        t, _ = _timed(lambda: threefold.load(pm, opt, path))
        times["threefold_load"].append(t)
        sd = _collect(pm, opt, rep, None, rank)
        t, _ = _timed(lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(direct), planner=LoadShards()))
        times["dcp_load"].append(t)
        if rank == 0:
            sizes = {"threefold": _dir_bytes(path), "dcp": _dir_bytes(direct)}
            shutil.rmtree(direct)
        dist.barrier()
    local = sum(p.numel() * p.element_size() for p in pm.engine.params.values())
    return {"times": times, "sizes": sizes, "local_param_bytes": local}


def _torch_save(args, root, reps):
    torch.set_num_threads(1)
    w = _workload(args)
    model = w["model"]
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    opt = {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                     for i, p in enumerate(model.parameters())}, "param_groups": [{"lr": 1e-3}]}
    path = os.path.join(root, "full.pt")
    save_t, load_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": sd, "optim": opt}, f)
            f.flush()
            os.fsync(f.fileno())
        save_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(path, weights_only=True)
        load_t.append(time.perf_counter() - t0)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"save": save_t, "load": load_t, "bytes": os.path.getsize(path), "param_bytes": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="tp=2")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from threefold.plan import Plan
    from threefold.runtime.launch import launch
    root = tempfile.mkdtemp(prefix="threefold-ckpt-bench-")
    try:
        full = _torch_save(args, root, args.reps)
        ranks = launch(_rank, Plan.parse(args.plan).world_size, args, root, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(max(r["times"][k][i] for r in ranks) for i in range(args.reps))
           for k in ranks[0]["times"]}
    sizes = ranks[0]["sizes"]
    out = {
        "plan": args.plan, "param_mb": full["param_bytes"] / 2**20,
        "seconds": {**med, "torch_save": statistics.median(full["save"]), "torch_load": statistics.median(full["load"])},
        "bytes": {"threefold": sizes["threefold"], "dcp": sizes["dcp"], "torch_save": full["bytes"]},
    }
    s, b = out["seconds"], out["bytes"]
    out["ratios"] = {
        "save_threefold_over_dcp": s["threefold_save"] / s["dcp_save"],
        "load_threefold_over_dcp": s["threefold_load"] / s["dcp_load"],
        "save_threefold_over_torch_save": s["threefold_save"] / s["torch_save"],
        "load_threefold_over_torch_load": s["threefold_load"] / s["torch_load"],
        "bytes_threefold_over_dcp": b["threefold"] / b["dcp"],
        "bytes_threefold_over_torch_save": b["threefold"] / b["torch_save"],
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"GPT {out['param_mb']:.1f} MB of fp32 parameters (+ AdamW moments), plan {args.plan}, "
          f"median of {args.reps}")
    print(f"{'':14}{'save s':>9}{'load s':>9}{'MB written':>12}")
    for name, sv, ld, by in (("threefold", s["threefold_save"], s["threefold_load"], b["threefold"]),
                             ("DCP direct", s["dcp_save"], s["dcp_load"], b["dcp"]),
                             ("torch.save", s["torch_save"], s["torch_load"], b["torch_save"])):
        print(f"{name:14}{sv:9.3f}{ld:9.3f}{by / 2**20:12.1f}")
    for k, v in out["ratios"].items():
        print(f"{k:34} {v:.3f}")


if __name__ == "__main__":
    main()
