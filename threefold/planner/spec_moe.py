"""A SPEC's mixture-of-experts layers, found in its traced graph (the structure
passes/experts.py finds in chunk graphs: grouped matmuls over [E, in, out] parameter weights
sharing per-expert row offsets), as the planner's `MoeLayer`.

`threefold plan SPEC` then prices the experts as `--experts/--top-k` do (planner/moe.py):
E/ep experts per rank, their GEMMs and all-to-alls by `moe_seconds`, and searches ep. From
block 0's region: E (the offsets' length), k (the region's rows / the example's tokens), h
(the first expert matmul's in-dim) and f chosen so that E x 3hf is the region's expert
parameter count (SwiGLU's 3 matrices; a 2-matrix GELU expert of width F gets f = 2F/3,
which keeps both its parameters and its FLOPs per row, 2 x params).
"""
from __future__ import annotations

from threefold.planner.model_cost import MoeLayer


def block_moe(traced, block_nodes: list, tokens: int) -> tuple[MoeLayer | None, set[str], set[str]]:
    """(the MoE layer of this block or None, its expert parameter FQNs, its region's node names)."""
    # lazy: start-up: threefold.passes.experts loads 14 more modules only when this runs
    from threefold.passes.experts import expert_matmul, expert_regions
    names = {n.name for n in block_nodes}
    regions = [r for r in expert_regions(traced.graph) if set(r["nodes"]) & names]
    if not regions or not tokens:
        return None, set(), set()
    r = regions[0]
    by_name = {n.name: n for n in traced.graph.nodes}
    first = next(by_name[n] for n in r["nodes"] if expert_matmul(by_name[n]) is not None)
    x, w, _, _ = expert_matmul(first)
    rows, hidden = int(x.meta["val"].shape[0]), int(w.meta["val"].shape[1])
    experts = r["experts"]
    fqns = {f for reg in regions for f in reg["params"]}
    params = sum(traced.state[f].numel() for f in r["params"])
    ffn = max(1, round(params / (3 * experts * hidden)))
    top_k = max(1, round(rows / tokens))
    nodes = {n for reg in regions for n in reg["nodes"]}
    return MoeLayer(experts, min(top_k, experts), ffn, hidden), fqns, nodes
