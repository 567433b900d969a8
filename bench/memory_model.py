"""Activation bytes per transformer layer (memory model = measured) vs Korthikanti et al., and
ZeRO-1 bytes per parameter.    python bench/memory_model.py

Per layer = (3 layers) - (2 layers) of one microbatch's saved-for-backward bytes on one rank,
from planner/memory.program_memory (graph-derived; tests/test_memory_model.py checks it
against PeakSavedCounter's measurement of real steps, every plan family, within 10%; it
matched within 0.3%). GPT s=64, h=64, a=8 (a*s/h = 8), b=2, dropout 0.1, t=4.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from threefold.compiler.api import compile_workload  # noqa: E402
from threefold.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from threefold.planner.memory import program_memory  # noqa: E402
from threefold.workload import Workload  # noqa: E402

S, H, A, B, T = 64, 64, 8, 2, 4
CASES = [("none", "", 1), ("tp", f"tp={T}", T), ("tp+sp", f"tp={T},sp=true", T),
         ("tp+sp+selective", f"tp={T},sp=true,recompute=selective", T), ("full", "recompute=full", 1)]


def workload(layers, batch=B):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=S, n_layer=layers, n_head=A, n_embd=H, dropout=0.1))
    idx = torch.randint(0, 128, (batch, S + 1), generator=torch.Generator().manual_seed(1))
    return Workload(model, (idx[:, :-1],), idx[:, 1:], lm_loss)


def per_layer(plan: str) -> float:
    acts = [program_memory(compile_workload(workload(n), plan))[0].activations for n in (2, 3)]
    return (acts[1] - acts[0]) / (S * B * H)


def main():
    torch.set_num_threads(1)
    ash, t = A * S / H, T
    paper = {"none": 34 + 5 * ash, "tp": 10 + 24 / t + 5 * ash / t, "tp+sp": (34 + 5 * ash) / t,
             "tp+sp+selective": 34 / t, "full": 2}
    # the same per-tensor accounting with 4-byte floats and 4-byte float dropout masks (ours)
    fp32 = {"none": 72 + 12 * ash, "tp": 24 + 48 / t + 12 * ash / t, "tp+sp": (72 + 12 * ash) / t,
            "tp+sp+selective": 72 / t, "full": 4}
    print(f"saved bytes per layer per rank, GPT s={S} h={H} a={A} b={B} (a*s/h={ash:g}), t={T}, units of sbh")
    print(f"{'case':<16} {'fp32':>7} {'fp32 acct':>9} {'ratio':>6} {'bf16':>7} {'paper 16b':>9} {'ratio':>6}")
    got = {}
    for name, plan, _ in CASES:
        f32 = per_layer(plan)
        b16 = per_layer(plan + ("," if plan else "") + "dtype=bf16")
        got[name] = f32
        print(f"{name:<16} {f32:7.2f} {fp32[name]:9.2f} {f32 / fp32[name]:6.3f} {b16:7.2f} {paper[name]:9.2f} "
              f"{b16 / paper[name]:6.3f}")
    print(f"none / tp+sp+selective (fp32): {got['none'] / got['tp+sp+selective']:.2f}x")
    w = workload(2, batch=4)   # dp=4 splits the batch
    elems = sum(p.numel() for p in w.model.parameters())
    for d in (2, 4):
        r = program_memory(compile_workload(w, f"dp={d},zero=1"))[0]
        print(f"zero=1 d={d}: {(r.params + r.grads + r.optimizer) / elems:.2f} bytes/param "
              f"(8 + 8/d = {8 + 8 / d:.2f}; params and grads fp32 under every dtype)")


def step_times(hidden=1024, heads=16, seq=256, layers=2, batch=2, steps=5):
    """Median step time per recompute mode, one process, modes interleaved (load hits all alike)."""
    import statistics
    import time

    import threefold
    torch.manual_seed(0)
    out = {}
    pms = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden,
                              dropout=0.1))
        idx = torch.randint(0, 512, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
        pms[mode] = (threefold.parallelize(model, f"recompute={mode}", (idx[:, :-1],), lm_loss,
                                           target=idx[:, 1:]), idx)
    times = {m: [] for m in pms}
    for pm, idx in pms.values():
        pm.step(idx[:, :-1], target=idx[:, 1:])
    for _ in range(steps):
        for m, (pm, idx) in pms.items():
            t = time.perf_counter()
            pm.step(idx[:, :-1], target=idx[:, 1:])
            times[m].append(time.perf_counter() - t)
    base = statistics.median(times["none"])
    print(f"step time, GPT L={layers} h={hidden} a={heads} s={seq} b={batch}, dropout 0.1, "
          f"{torch.get_num_threads()} thread(s), median of {steps}:")
    for m in pms:
        med = statistics.median(times[m])
        out[m] = med / base
        print(f"  {m:<9} {med * 1e3:7.0f} ms  x{med / base:.3f}")
    return out


if __name__ == "__main__":
    if "--time" in sys.argv:
        torch.set_num_threads(1)
        step_times()
    else:
        main()
