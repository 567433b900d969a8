"""Pipeline balance: forward-FLOPs imbalance (max/mean over chunks) of the stage cuts.

A 24-layer GPT of GPT-2-medium shape (hidden 1024, 16 heads, vocab 50304, sequence 1024,
microbatch 1) on the meta device, cut by `passes/pipeline_split.py` for pp=4 and pp=8 (and
interleaved v=2). The embedding, the final norm, the tied LM head and the loss are counted;
the goal is imbalance <= 1.10. For reference the table also shows what whole-layer cuts
(Megatron's layers/pp per stage, embedding on the first and head on the last) would give.
Prints Markdown.

    python bench/balance.py [--layers 24] [--pp 4 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.gpt import gpt_medium_meta  # noqa: E402
from threefold.compiler.api import compile_workload  # noqa: E402
from threefold.passes.cost import chunk_costs, imbalance  # noqa: E402


def layer_cut_imbalance(prog, k: int) -> float:
    """Imbalance of the best whole-layer assignment (embedding first, head last), for contrast."""
    layers: dict[int, int] = {}
    pre = post = 0
    first: dict = {}   # each traced op once, from the first chunk graph that holds it
    for _, node in prog.chunk_nodes():
        first.setdefault(node.name, node)
    for node in (first[name] for name in prog.source_order if name in first):
        cost = node.meta.get("tf", {}).get("cost")
        if cost is None:
            continue
        parts = node.meta["tf"].get("module", "").split(".")
        if parts[0] == "h" and len(parts) > 1:
            layers[int(parts[1])] = layers.get(int(parts[1]), 0) + cost.flops
        elif layers:
            post += cost.flops
        else:
            pre += cost.flops
    per = [layers[i] for i in sorted(layers)]
    best = None
    # contiguous layer groups: dynamic programming over (layers used, stages used)
    n = len(per)
    inf = float("inf")
    dp = [[inf] * (k + 1) for _ in range(n + 1)]
    dp[0][0] = 0
    prefix = [0]
    for f in per:
        prefix.append(prefix[-1] + f)
    for j in range(1, k + 1):
        for i in range(0, n + 1):
            for s in range(0, i + 1):
                if dp[s][j - 1] == inf:
                    continue
                chunk = prefix[i] - prefix[s] + (pre if j == 1 else 0) + (post if j == k else 0)
                dp[i][j] = min(dp[i][j], max(dp[s][j - 1], chunk))
    best = dp[n][k]
    total = sum(per) + pre + post
    return best / (total / k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args(argv)
    print(f"GPT-2-medium shape, {args.layers} layers, h=1024, 16 heads, V=50304, s=1024, "
          "microbatch 1, meta device\n")
    print("| plan | chunks | imbalance (max/mean FLOPs) | whole-layer cuts | chunk forward GFLOPs | "
          "boundary tensors per cut | compile s |")
    print("|---|---|---|---|---|---|---|")
    for pp in args.pp:
        for v in (1, 2):
            plan = f"pp={pp}" + (f",v={v},schedule=interleaved" if v > 1 else "")
            start = time.perf_counter()
            prog = compile_workload(gpt_medium_meta(args.layers), plan)
            seconds = time.perf_counter() - start
            flops = [c.flops for c in chunk_costs(prog)]
            tensors = [len(c.inputs) for c in prog.chunks[1:]]
            print(f"| {plan} | {len(flops)} | {imbalance(flops):.3f} | "
                  f"{layer_cut_imbalance(prog, len(flops)):.3f} | "
                  f"{' '.join(f'{f / 1e9:.0f}' for f in flops)} | "
                  f"{max(tensors)} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
