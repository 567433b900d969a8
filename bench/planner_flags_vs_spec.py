"""The planner's two descriptions of one model side by side: shape flags (gpt_cost.py,
moe.py) against the SPEC path (spec_cost.py, the traced graph and the compiler's own
tensor-parallel and fusion passes), on the same Llama-like or Mixtral-like model built on
the meta device. For every plan the search ranks, the ratio of the two predicted times
(the model's own sum, before the measured ceiling) and of the two predicted memories per
GPU; printed per (tp, pp).

    python bench/planner_flags_vs_spec.py [--model llama7b|llama3-70b|mixtral] [--layers N]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

SHAPES = {   # layers, hidden, heads, kv heads, ffn, vocab, seq, experts, top-k
    "llama7b": (32, 4096, 32, 8, 14336, 32000, 4096, 0, 0),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 4096, 0, 0),
    "mixtral": (32, 4096, 32, 8, 14336, 32000, 4096, 8, 2),
}


def hf_model(shape: tuple, layers: int):
    """A Hugging Face Llama (or Mixtral, with experts) of this shape on the meta device, with a
    one-sequence batch: the SPEC path's input."""
    import torch
    import transformers
    _, h, a, kv, f, V, s, E, k = shape
    common = dict(hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, intermediate_size=f,
                  num_hidden_layers=layers, vocab_size=V, max_position_embeddings=s, use_cache=False,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    if E:
        cfg = transformers.MixtralConfig(num_local_experts=E, num_experts_per_tok=k, **common)
        cls = transformers.MixtralForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    from examples.hf import LogitsOnly, lm_loss
    with torch.device("meta"):
        model = LogitsOnly(cls(cfg))
    tokens = torch.zeros(1, s, dtype=torch.long, device="meta")
    return {"model": model, "inputs": (tokens,), "target": tokens, "loss_fn": lm_loss}


def both_costs(shape: tuple, layers: int):
    """(SPEC ModelCost, flags ModelCost) of the same model."""
    from threefold.compiler.trace import trace
    from threefold.planner.gpt_cost import gpt_model_cost
    from threefold.planner.moe import moe_model_cost
    from threefold.planner.spec_cost import model_cost_from_program
    _, h, a, kv, f, V, s, E, k = shape
    w = hf_model(shape, layers)
    spec = model_cost_from_program(trace(w["model"], w["inputs"], w["target"], w["loss_fn"]), w["inputs"], "spec")
    if E:
        flags = moe_model_cost(layers, h, a, E, k, f, V, s, kv_heads=kv, tied=False, mlp="swiglu")
    else:
        flags = gpt_model_cost(layers, h, a, V, s, ffn=f, kv_heads=kv, mlp="swiglu", tied=False)
    return spec, flags


def full_depth(spec, flags, shape: tuple):
    """(SPEC, flags) ModelCosts at the shape's real layer count: the SPEC's traced per-layer
    figures for every layer, the flags given that depth."""
    import dataclasses
    from threefold.planner.gpt_cost import gpt_model_cost
    from threefold.planner.moe import moe_model_cost
    L, h, a, kv, f, V, s, E, k = shape
    if E:
        deep = moe_model_cost(L, h, a, E, k, f, V, s, kv_heads=kv, tied=False, mlp="swiglu")
    else:
        deep = gpt_model_cost(L, h, a, V, s, ffn=f, kv_heads=kv, mlp="swiglu", tied=False)
    return dataclasses.replace(spec, layers=L), deep


def ratios(spec, flags, batch: int, gpus: int, cluster, ranked_only: bool = False) -> dict:
    """{(tp, pp): [flags / SPEC predicted time of each legal plan]}; `ranked_only`: only the
    plans the search ranks (those that fit in memory by either description)."""
    from threefold.planner.estimate import estimate
    from threefold.planner.search import legal_configs
    out = defaultdict(list)
    for cfg in legal_configs(spec, batch, gpus, cluster):
        a, b = estimate(spec, cfg, cluster), estimate(flags, cfg, cluster)
        if ranked_only and not (a.fits or b.fits):
            continue
        out[(cfg.tp, cfg.pp)].append(b.model_s / a.model_s)
    return dict(out)


def memory_ratios(spec, flags, batch: int, gpus: int, cluster) -> dict:
    """{(tp, pp): [flags / SPEC predicted memory per GPU (the fullest stage) of each legal plan]}."""
    from threefold.planner.estimate import estimate
    from threefold.planner.search import legal_configs
    out = defaultdict(list)
    for cfg in legal_configs(spec, batch, gpus, cluster):
        out[(cfg.tp, cfg.pp)].append(estimate(flags, cfg, cluster).memory_bytes
                                     / estimate(spec, cfg, cluster).memory_bytes)
    return dict(out)


def best_plans(spec, flags, batch: int, gpus: int, cluster) -> list[str]:
    """Each description's best plan, its predicted TFLOP/s (shown, and the model's own) and memory."""
    from threefold.planner.search import rank_plans
    out = []
    for label, model in (("SPEC", spec), ("flags", flags)):
        e = rank_plans(model, batch, gpus, cluster)[0]
        own = e.flops_per_iteration / e.model_s / gpus / 1e12
        out.append(f"{label}: best {e.config.plan} (b={e.config.microbatch_size}) {e.tflops_per_gpu:.1f} TFLOP/s"
                   f"{' (held; own ' + format(own, '.1f') + ')' if e.capped else ''}, "
                   f"{e.memory_bytes / 2**30:.1f} GiB")
    return out


def main(argv=None) -> int:
    from threefold.planner.cluster import load_cluster
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama7b")
    p.add_argument("--layers", type=int, default=4, help="layers to trace (default 4; pp up to it)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--cluster", default="h100-80gb")
    args = p.parse_args(argv)
    spec, flags = both_costs(SHAPES[args.model], args.layers)
    print(f"{args.model} ({args.layers} layers): parameters flags {flags.params / 1e9:.3f}B, "
          f"SPEC {spec.params / 1e9:.3f}B")
    cluster = load_cluster(args.cluster)
    print("\n".join(best_plans(spec, flags, args.batch, args.gpus, cluster)))
    depth = SHAPES[args.model][0]
    if depth != args.layers:   # the real depth: the traced per-layer figures, every layer
        print(f"at the model's {depth} layers:")
        print("\n".join(best_plans(*full_depth(spec, flags, SHAPES[args.model]), args.batch, args.gpus, cluster)))
    every = ratios(spec, flags, args.batch, args.gpus, cluster)
    ranked = ratios(spec, flags, args.batch, args.gpus, cluster, ranked_only=True)
    print("| tp | pp | plans (ranked) | flags/SPEC min | max | worst | worst ranked |")
    print("|---|---|---|---|---|---|---|")
    for key, r in sorted(every.items()):
        rr = ranked.get(key, [])
        print(f"| {key[0]} | {key[1]} | {len(r)} ({len(rr)}) | {min(r):.3f} | {max(r):.3f} | "
              f"{max(abs(x - 1) for x in r):.1%} | {max((abs(x - 1) for x in rr), default=0):.1%} |")
    memory = memory_ratios(spec, flags, args.batch, args.gpus, cluster)
    print("\n| tp | pp | plans | memory flags/SPEC min | max |")
    print("|---|---|---|---|---|")
    for key, r in sorted(memory.items()):
        print(f"| {key[0]} | {key[1]} | {len(r)} | {min(r):.3f} | {max(r):.3f} |")
    print(f"memory: largest difference {max(abs(x - 1) for r in memory.values() for x in r):.1%} over every legal plan")
    worst = max(abs(x - 1) for r in every.values() for x in r)
    worst_ranked = max((abs(x - 1) for r in ranked.values() for x in r), default=0)
    print(f"largest difference: {worst:.1%} over every legal plan, {worst_ranked:.1%} over the ranked ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
