"""The all-gather fallback of context parallelism: bytes per rank per step, measured from the
collectives a real step runs, against the compiler's note (what `inspect` prints) and the
formula 2 * m * (cp-1) * local bytes (all-gather forward + reduce-scatter backward, ring
algorithm: each rank sends cp-1 of the cp pieces).

    python bench/cp_fallback.py [seq]

Models: tests/cp_mask_models.Mixing (embedding 16 wide -> cumsum over time / a non-causal
conv1d / mean over the sequence -> head), batch 4. Measured: every all_gather input and
reduce-scatter input a rank's step passes to torch.distributed, counted as the ring
algorithm sends them ((cp-1) x the local piece).
"""
from __future__ import annotations

import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from threefold.runtime.launch import launch  # noqa: E402


def one_rank(mode: str, plan: str, seq: int) -> dict:
    import torch.distributed as dist

    import threefold
    from threefold.compiler.api import compile_workload
    from threefold.runtime import zero
    from tests.cp_mask_models import mixing_workload
    torch.set_num_threads(1)
    w = mixing_workload(mode, seq=seq)
    prog = compile_workload(w, plan)
    noted = sum(int(m.group(1)) for n in prog.notes for m in [re.search(r"(\d+) bytes per rank per step", n)]
                if n.startswith("cp fallback:") and m)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    cp = dist.get_world_size()
    sent = [0]
    real_ag, real_rs = dist.all_gather, zero._REDUCE_SCATTER_FLAT

    def ag(parts, t, *a, **k):
        sent[0] += (cp - 1) * t.numel() * t.element_size()
        return real_ag(parts, t, *a, **k)

    def rs(out, inp, *a, **k):
        sent[0] += (cp - 1) * out.numel() * out.element_size()
        return real_rs(out, inp, *a, **k)
    dist.all_gather, zero._REDUCE_SCATTER_FLAT = ag, rs
    try:
        loss = pm.step(*w["inputs"], target=w["target"])
    finally:
        dist.all_gather, zero._REDUCE_SCATTER_FLAT = real_ag, real_rs
    return {"sent": sent[0], "noted": noted, "loss": loss}


def formula(seq: int, cp: int, batch: int = 4, width: int = 16) -> int:
    return 2 * 1 * (cp - 1) * batch * (seq // cp) * width * 4


def main(seq: int = 1024) -> None:
    print(f"Mixing models, batch 4, width 16, seq {seq}, m=1, fp32")
    print("model   cp  measured B/rank/step  noted (inspect)  formula")
    for mode in ("cumsum", "conv", "pool"):
        for cp in (2, 4):
            res = launch(one_rank, cp, mode, f"cp={cp}", seq, timeout=600)
            sent = max(r["sent"] for r in res)
            print(f"{mode:<7} {cp:>2}  {sent:>20}  {res[0]['noted']:>15}  {formula(seq, cp):>7}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
