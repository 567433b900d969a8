"""Mixed precision and ZeRO, measured (BENCHMARKS.md "Mixed precision and ZeRO-1", "ZeRO-2/3").

  python bench/precision_zero.py memory    # bytes per trainable element, zero=0..3, HSDP, d=2/4
  python bench/precision_zero.py bf16      # parallel bf16 vs single-process autocast, in sigmas
                                           # of the bf16 rounding noise; boundary wire fp32 vs bf16
  python bench/precision_zero.py casts     # peak saved bytes per stage, bf16 1F1B, weight copies
                                           # per step (CastCache) vs per microbatch

Bytes are what each rank holds (runtime/zero.held_bytes: parameters, gradients, optimizer
state, each storage once) divided by its trainable elements, after an AdamW step. bf16 also
reports the bf16 copies of weights that autocast's casts leave saved for backward per
microbatch (saved-tensor hooks: the part of one forward's saved bytes that does not grow
with the batch).
"""
from __future__ import annotations

import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.parity import load_workload  # noqa: E402
from tests.precision_runs import reference, rounding_noise  # noqa: E402

GPT = {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq": 16, "batch": 8}


def _memory(plans: list[str]) -> list[dict]:
    """On each rank, per plan: bytes held per trainable element after an AdamW step, zero=3's
    peak gathered working set, and the memory model's estimate (what `inspect --memory` prints)."""
    import threefold
    from threefold.compiler.api import compile_workload
    from threefold.planner.memory import program_memory
    from threefold.runtime.zero import held_bytes
    from threefold.workload import Workload
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    out = []
    for plan in plans:
        w = load_workload("gpt", **GPT)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            pm.step(*w["inputs"], target=w["target"])
            opt.step()
        b = held_bytes(pm.engine, opt)
        n = b["elements"]
        sharded = pm.engine.sharded
        gathered = sharded.peak_gathered_bytes if sharded is not None else 0
        prog = compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]), plan)
        est = next(r for r in program_memory(prog) if r.rank == rank).to_json()
        estimate = est["params"] + est.get("gathered", 0) + est["grads"] + est["optimizer"]
        out.append({"plan": plan, "params": b["params"] / n, "grads": b["grads"] / n,
                    "optimizer": b["optimizer"] / n, "gathered": gathered / n,
                    "estimate": estimate / n})
    return out


def _formula(plan: str, d: int) -> str:
    zero = int(plan.split("zero=")[1].split(",")[0]) if "zero=" in plan else 0
    text = {0: "16", 1: f"8+8/d={8 + 8 / d:.2f}", 2: f"4+12/d={4 + 12 / d:.2f}",
            3: f"16/d+ws={16 / d:.2f}+ws"}[zero]
    return text + (f" (Megatron 6+12/d={6 + 12 / d:.2f})" if "bf16" in plan else "")


def memory() -> None:
    """Bytes per trainable element on the worst rank: measured (parameters + gradients +
    optimizer state + zero=3's gathered working set) against the formula and the estimate."""
    from threefold.runtime.launch import launch
    print(f"{'plan':<28}{'params':>8}{'grads':>8}{'optim':>8}{'gather':>8}{'total':>8}{'estim':>8}"
          f"{'est/meas':>9}  formula")
    for world, plans in ((2, ["dp=2", "dp=2,zero=1", "dp=2,zero=1,dtype=bf16", "dp=2,zero=2",
                              "dp=2,zero=3"]),
                         (4, ["dp=4", "dp=4,zero=1", "dp=4,zero=1,dtype=bf16", "dp=2,tp=2,zero=1",
                              "dp=4,zero=2", "dp=4,zero=3", "dp=4,zero=3,dp_shard=2",
                              "dp=2,tp=2,zero=3"])):
        per_rank = launch(_memory, world, plans, timeout=900)
        for i, plan in enumerate(plans):
            rows = [ranks[i] for ranks in per_rank]
            total = lambda r: r["params"] + r["grads"] + r["optimizer"] + r["gathered"]  # noqa: E731
            r = max(rows, key=total)
            d = int(plan.split("dp=")[1].split(",")[0])
            if "dp_shard=" in plan:
                d = int(plan.split("dp_shard=")[1].split(",")[0])
            print(f"{plan:<28}{r['params']:>8.2f}{r['grads']:>8.2f}{r['optimizer']:>8.2f}"
                  f"{r['gathered']:>8.2f}{total(r):>8.2f}{r['estimate']:>8.2f}"
                  f"{r['estimate'] / total(r):>9.3f}  {_formula(plan, d)}")
    w = weight_casts()
    print(f"bf16 weight copies autocast saves for backward, per microbatch in flight: {w:.2f} bytes/element")


def weight_casts() -> float:
    """Saved-for-backward bytes of one autocast forward that do not grow with the batch
    (saved(b) = W + A*b, so W = 2 saved(1) - saved(2)), per parameter element."""
    def saved(batch: int) -> int:
        w = load_workload("gpt", **{**GPT, "batch": batch})
        seen: dict = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = w["loss_fn"](w["model"](*w["inputs"]), w["target"])
        params = {p.untyped_storage().data_ptr() for p in w["model"].parameters()}
        del loss
        return sum(n for ptr, n in seen.items() if ptr not in params)
    n = sum(p.numel() for p in load_workload("gpt", **GPT)["model"].parameters())
    return (2 * saved(1) - saved(2)) / n


def _bf16_runs(plans: list[str], wire: str) -> list[dict]:
    from tests.precision_runs import parallel
    if wire == "bf16":   # what sending boundaries in the compute dtype would do
        import threefold.runtime.mixed_precision as mp
        mp.wire_dtype = lambda manifest: mp.compute_dtype(manifest)
    return parallel(plans, "gpt", GPT, 4, "sgd")


def bf16() -> None:
    from threefold.runtime.launch import launch
    steps = 4
    ref = reference("gpt", GPT, steps, "sgd", torch.bfloat16)
    fp32 = reference("gpt", GPT, steps, "sgd")
    sigma = rounding_noise("gpt", GPT, steps, "sgd", torch.bfloat16, draws=8)
    print("single-process autocast bf16 losses:", [f"{x:.6f}" for x in ref])
    print("sigma (bf16 rounding noise of the loss, per step):", [f"{s:.2e}" for s in sigma])
    print("tolerance 4*sqrt(2)*sigma:", [f"{4 * math.sqrt(2) * s:.2e}" for s in sigma])
    print("fp32 vs bf16 reference, in sigma:", [f"{abs(a - b) / s:.2f}" for a, b, s in zip(fp32, ref, sigma)])
    plans = ["dp=2,dtype=bf16", "tp=2,dtype=bf16", "pp=2,m=2,dtype=bf16", "pp=2,m=2,v=2,schedule=interleaved,dtype=bf16",
             "dp=2,zero=1,dtype=bf16"]
    for wire in ("fp32", "bf16"):
        rows = launch(_bf16_runs, 2, plans, wire, timeout=600)[0]
        for r in rows:
            if wire == "bf16" and "pp=" not in r["plan"]:
                continue   # the wire dtype only matters across pipeline stages
            dev = [abs(a - b) / s for a, b, s in zip(r["losses"], ref, sigma)]
            print(f"wire={wire:<5}{r['plan']:<46} |parallel - autocast| / sigma: "
                  + " ".join(f"{x:.2f}" for x in dev) + f"   max {max(dev):.2f} (limit {4 * math.sqrt(2):.2f})")


def _peak_saved(plan: str, shared: bool) -> dict:
    import threefold
    import threefold.runtime.mixed_precision as mp
    from threefold.runtime.memory import PeakSavedCounter
    torch.set_num_threads(1)
    if not shared:   # autocast's own behaviour: copies made per forward, kept per microbatch
        mp.CastCache.hold = lambda self: None
    w = load_workload("gpt", **GPT)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    params = list(pm.parameters())
    with PeakSavedCounter(exclude=params) as c:
        pm.step(*w["inputs"], target=w["target"])
    return {"stage": pm.engine.stage, "peak": c.peak_bytes, "elements": sum(p.numel() for p in params)}


def casts() -> None:
    from threefold.runtime.launch import launch
    for plan in ("pp=2,m=4,dtype=bf16", "pp=2,m=4"):
        for shared in ((True, False) if "bf16" in plan else (True,)):
            rows = launch(_peak_saved, 2, plan, shared, timeout=600)
            label = "" if "bf16" not in plan else (" weight copies per step" if shared else
                                                   " weight copies per microbatch")
            print(f"{plan + label:<50}" + "  ".join(
                f"stage {r['stage']}: {r['peak'] / 1024:.0f} KiB ({r['peak'] / r['elements']:.2f} B/param)"
                for r in rows))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "memory"
    {"memory": memory, "bf16": bf16, "casts": casts}[what]()
