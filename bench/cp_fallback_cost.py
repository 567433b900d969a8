"""Context parallelism's all-gather fallback against its position-wise path, on models where
both apply. Bytes each rank sends per step (measured from the collectives and sends a real
step runs) and the median step time, cp=2, gloo on CPU.

    python bench/cp_fallback_cost.py [seq] [steps] [attention|scan]

attention: causal SDPA (tests/cp_mask_models.PositionTables("rotary"), batch 2, width 16, 2
  heads of 8) run as ring attention (K/V blocks passed around the ring) or, forced, on the
  all-gathered sequence (q, k, v gathered, attention run whole, output cut back).
scan: causal linear attention written with cumsums over time (tests/zoo/handwritten_scans.py,
  batch 2, width 32, 4 heads of 8) with each block carrying the totals of the blocks before it
  (runtime/cp_scan.py) or, forced, with the cumsums run on the gathered sequence.
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


def _workload(model: str, seq: int) -> dict:
    import torch
    from tests.cp_mask_models import PositionTables, lm_loss
    from tests.zoo.handwritten_scans import LinearAttention
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if model == "attention":
        idx = torch.randint(0, 32, (2, seq + 1), generator=g)
        net = PositionTables("rotary", rows=seq)
    else:
        from tests.zoo import common
        from tests.zoo.handwritten_attention import TinyDecoder
        idx = torch.randint(0, common.VOCAB, (2, seq + 1), generator=g)
        net = TinyDecoder(LinearAttention)
        net.wpe = torch.nn.Embedding(seq, common.HIDDEN)
    return {"model": net, "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}


def one_rank(path: str, seq: int, steps: int, model: str = "attention") -> dict:
    import torch
    import torch.distributed as dist

    import threefold
    from threefold.passes import cp_attention
    from threefold.runtime import comm, cp_scan, zero
    torch.set_num_threads(1)
    if path == "fallback":
        cp_attention._sdpa = lambda node: None          # the ring does not take it: gathered
        cp_scan.CARRIED = frozenset()                   # no scan carries: gathered
    w = _workload(model, seq)
    pm = threefold.parallelize(w["model"], "cp=2", w["inputs"], w["loss_fn"], target=w["target"])
    cp = dist.get_world_size()
    sent = [0]
    real = (dist.all_gather, zero._REDUCE_SCATTER_FLAT, dist.isend, comm.all_reduce)

    def ag(parts, t, *a, **k):
        sent[0] += (cp - 1) * t.numel() * t.element_size()
        return real[0](parts, t, *a, **k)

    def rs(out, inp, *a, **k):
        sent[0] += (cp - 1) * out.numel() * out.element_size()
        return real[1](out, inp, *a, **k)

    def isend(t, *a, **k):
        sent[0] += t.numel() * t.element_size()
        return real[2](t, *a, **k)

    def ar(t, group, what, *a, **k):   # the scan carries' gradients (not the parameters' own)
        if "scan" in what:
            sent[0] += 2 * (cp - 1) * t.numel() * t.element_size() // cp
        return real[3](t, group, what, *a, **k)
    pm.step(*w["inputs"], target=w["target"])               # warm-up
    dist.all_gather, zero._REDUCE_SCATTER_FLAT, dist.isend, comm.all_reduce = ag, rs, isend, ar
    try:
        pm.step(*w["inputs"], target=w["target"])
    finally:
        dist.all_gather, zero._REDUCE_SCATTER_FLAT, dist.isend, comm.all_reduce = real
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = pm.step(*w["inputs"], target=w["target"])
        times.append(time.perf_counter() - t0)
    return {"sent": sent[0], "step_s": statistics.median(times), "loss": loss}


def main(seq: int = 4096, steps: int = 3, model: str = "attention") -> None:
    title = {"attention": "PositionTables(rotary), causal SDPA, batch 2, width 16",
             "scan": "TinyDecoder(LinearAttention), cumsums over time, batch 2, width 32"}[model]
    print(f"{title}, seq {seq}, cp=2, fp32, gloo CPU")
    print("path      B sent/rank/step  median step s  loss")
    for path in (("ring" if model == "attention" else "carry"), "fallback"):
        res = launch(one_rank, 2, path, seq, steps, model, timeout=900)
        print(f"{path:<9} {max(r['sent'] for r in res):>16}  {max(r['step_s'] for r in res):>13.3f}  {res[0]['loss']:.6f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:2]), *args[2:3])
