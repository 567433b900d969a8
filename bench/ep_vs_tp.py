"""Expert parallelism against tensor parallelism on the same MoE, and what ep moves.

    python bench/ep_vs_tp.py [--experts 8] [--hidden 64] [--steps 8] [--ranks 4]

A tiny Mixtral from a local config (top-2 of E experts, 2 layers, batch 8 x 32 tokens):
  1. step time on 2 ranks under tp=2 and under dp=2,ep=2 (the same global batch), median
     of --steps SGD steps after 2 warm-up steps, with the load average (the machine is shared);
  2. under dp=R,ep=R (R = --ranks): the share of the experts' parameters each rank holds
     (measured from pm.named_parameters()), and the all-to-all bytes of one step per MoE
     layer, summed over ranks, against tokens x top-k x hidden x 4 bytes x 2 (dispatch and
     combine) x 2 (forward and backward).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH, SEQ, VOCAB, LAYERS, TOP_K = 8, 32, 128, 2, 2


def workload(experts: int, hidden: int):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=experts, num_experts_per_tok=TOP_K, use_cache=False,
                                     max_position_embeddings=SEQ, attn_implementation="eager")
    from tests.zoo.common import LogitsOnly, lm_loss
    model = LogitsOnly(transformers.MixtralForCausalLM(cfg)).train()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"model": model, "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}


def rank_main(plan: str, experts: int, hidden: int, steps: int) -> dict:
    import threefold
    from tests.a2a_bytes import counting_all_to_all
    torch.set_num_threads(1)
    w = workload(experts, hidden)
    full = {n: p.numel() for n, p in w["model"].named_parameters()}
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    opt = pm.optimizer(torch.optim.SGD, lr=0.01)
    times = []
    with counting_all_to_all() as sent:   # tests/a2a_bytes.py: bytes per all_to_all label
        for k in range(steps + 2):
            sent.clear()
            t0 = time.perf_counter()
            opt.zero_grad()
            pm.step(*w["inputs"], target=w["target"])
            opt.step()
            if k >= 2:
                times.append(time.perf_counter() - t0)
    experts_fqns = pm.manifest.get("experts") or {}
    held = sum(p.numel() for f, p in pm.named_parameters() if f in experts_fqns)
    whole = sum(full[f] for f in experts_fqns)
    return {"median_s": statistics.median(times), "held": held, "whole": whole,
            "a2a_bytes_last_step": {k: v for k, v in sent.items() if k != "tokens per expert"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    from threefold.runtime.launch import launch
    print(f"Mixtral tiny: E={args.experts}, top-{TOP_K}, hidden {args.hidden}, {LAYERS} layers, "
          f"batch {BATCH} x {SEQ}; load average {os.getloadavg()[0]:.1f}")
    for plan in ("tp=2", "dp=2,ep=2"):
        res = launch(rank_main, 2, plan, args.experts, args.hidden, args.steps, timeout=900)
        print(f"  {plan:<12} step {max(r['median_s'] for r in res) * 1e3:8.1f} ms (median of {args.steps}, "
              f"slowest rank); load average {os.getloadavg()[0]:.1f}")
    r = args.ranks
    res = launch(rank_main, r, f"dp={r},ep={r}", args.experts, args.hidden, 2, timeout=900)
    print(f"  dp={r},ep={r}: each rank holds {res[0]['held']} of {res[0]['whole']} expert parameters "
          f"({res[0]['held'] / res[0]['whole']:.4f}; 1/{r} = {1 / r:.4f})")
    total = sum(sum(x["a2a_bytes_last_step"].values()) for x in res)
    formula = BATCH * SEQ * TOP_K * args.hidden * 4 * 2 * 2 * LAYERS
    print(f"  all-to-all bytes per step, all ranks: {total} = {total // LAYERS} per layer; formula "
          f"tokens x top-k x hidden x 4 B x 2 (there, back) x 2 (fwd, bwd) = {formula // LAYERS} per layer")


if __name__ == "__main__":
    main()
