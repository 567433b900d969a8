"""Context parallelism's all-gather fallback against its position-wise path on one model
where both apply: causal SDPA, run as ring attention (K/V blocks passed around the ring)
or, forced, on the all-gathered sequence (q, k, v gathered, attention run whole, output cut
back). Bytes each rank sends per step (measured from the collectives and sends a real step
runs) and the median step time, cp=2, gloo on CPU.

    python bench/cp_fallback_vs_ring.py [seq] [steps]

Model: tests/cp_mask_models.PositionTables("rotary") at batch 2, width 16 (2 heads of 8).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # bench/kernels.py shadows `kernels`
sys.path.insert(0, os.path.dirname(_HERE))

from threefold.runtime.launch import launch  # noqa: E402


def one_rank(path: str, seq: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import threefold
    from threefold.passes import cp_attention
    from threefold.runtime import zero
    from tests.cp_mask_models import PositionTables, lm_loss
    torch.set_num_threads(1)
    if path == "fallback":
        cp_attention._sdpa = lambda node: None          # the ring does not take it: gathered
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (2, seq + 1), generator=g)
    w = {"model": PositionTables("rotary", rows=seq), "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}
    pm = threefold.parallelize(w["model"], "cp=2", w["inputs"], w["loss_fn"], target=w["target"])
    cp = dist.get_world_size()
    sent = [0]
    real = (dist.all_gather, zero._REDUCE_SCATTER_FLAT, dist.isend)

    def ag(parts, t, *a, **k):
        sent[0] += (cp - 1) * t.numel() * t.element_size()
        return real[0](parts, t, *a, **k)

    def rs(out, inp, *a, **k):
        sent[0] += (cp - 1) * out.numel() * out.element_size()
        return real[1](out, inp, *a, **k)

    def isend(t, *a, **k):
        sent[0] += t.numel() * t.element_size()
        return real[2](t, *a, **k)
    pm.step(*w["inputs"], target=w["target"])               # warm-up
    dist.all_gather, zero._REDUCE_SCATTER_FLAT, dist.isend = ag, rs, isend
    try:
        pm.step(*w["inputs"], target=w["target"])
    finally:
        dist.all_gather, zero._REDUCE_SCATTER_FLAT, dist.isend = real
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = pm.step(*w["inputs"], target=w["target"])
        times.append(time.perf_counter() - t0)
    return {"sent": sent[0], "step_s": statistics.median(times), "loss": loss}


def main(seq: int = 4096, steps: int = 3) -> None:
    print(f"PositionTables(rotary), causal SDPA, batch 2, width 16, seq {seq}, cp=2, fp32, gloo CPU")
    print("path      B sent/rank/step  median step s  loss")
    for path in ("ring", "fallback"):
        res = launch(one_rank, 2, path, seq, steps, timeout=900)
        print(f"{path:<9} {max(r['sent'] for r in res):>16}  {max(r['step_s'] for r in res):>13.3f}  {res[0]['loss']:.6f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
