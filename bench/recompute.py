"""Activation recomputation: saved bytes per layer (measured) and step time, none/selective/full.

    python bench/recompute.py            # single process, CPU, fp32, dropout 0.1

Bytes: runtime/memory.SavedTensorCounter over one forward of the compiled chunk, one layer =
(3 layers) - (2 layers); against Korthikanti et al. (16-bit, 1-byte masks) and the same
accounting at fp32 with our 4-byte float dropout masks. Time: median of 8 steps per mode,
modes interleaved so machine load hits all three alike.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import threefold  # noqa: E402
from threefold.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from threefold.runtime.memory import SavedTensorCounter  # noqa: E402

MODES = ("none", "selective", "full")


def build(mode, layers, s, h, a, b, vocab=512, p=0.1):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=s, n_layer=layers, n_head=a, n_embd=h, dropout=p))
    idx = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(1))
    pm = threefold.parallelize(model, f"recompute={mode}", (idx[:, :-1],), lm_loss, target=idx[:, 1:])
    return pm, idx


def saved_bytes(mode, layers, s, h, a, b):
    pm, idx = build(mode, layers, s, h, a, b)
    (mod,) = pm.engine.modules.values()
    mod.train()
    with SavedTensorCounter(exclude=list(mod.parameters()) + list(mod.buffers())) as counter:
        mod(idx[:, :-1], idx[:, 1:])
    return counter.bytes


def main():
    torch.set_num_threads(1)
    s, h, a, b = 64, 32, 4, 2
    sbh, ash = s * b * h, a * s / h
    print(f"saved bytes per layer, GPT s={s} h={h} a={a} b={b} (a*s/h={ash:g}), fp32, in units of sbh:")
    paper = {"none": 34 + 5 * ash, "selective": 34, "full": 2}
    fp32 = {"none": 72 + 12 * ash, "selective": 72, "full": 4}
    for mode in MODES:
        per = (saved_bytes(mode, 3, s, h, a, b) - saved_bytes(mode, 2, s, h, a, b)) / sbh
        print(f"  {mode:<9} measured {per:7.2f}   fp32 accounting {fp32[mode]:6.1f}   "
              f"paper (16-bit) {paper[mode]:6.1f}   measured/2 {per / 2:6.2f}")
    s, h, a, L, b = 256, 256, 8, 4, 4
    pms = {m: build(m, L, s, h, a, b) for m in MODES}
    times = {m: [] for m in MODES}
    for pm, idx in pms.values():
        pm.step(idx[:, :-1], target=idx[:, 1:])
    for _ in range(8):
        for m, (pm, idx) in pms.items():
            t = time.perf_counter()
            pm.step(idx[:, :-1], target=idx[:, 1:])
            times[m].append(time.perf_counter() - t)
    base = statistics.median(times["none"])
    print(f"step time, GPT L={L} h={h} a={a} s={s} b={b}, 1 thread:")
    for m in MODES:
        print(f"  {m:<9} median {statistics.median(times[m]) * 1e3:6.0f} ms  x{statistics.median(times[m]) / base:.2f}")


if __name__ == "__main__":
    main()
