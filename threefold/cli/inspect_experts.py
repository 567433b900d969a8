"""`inspect`'s expert-parallel report: per MoE layer (expert region, passes/experts.py) the
experts each ep rank holds, the tokens the example batch routes to each expert, and the
bytes one rank's all-to-alls move per microbatch.

Tokens per expert are measured, not guessed: the chunk graphs run on the example batch
(every dp rank's microbatches, one after another, on the compiled graphs with the full
weights) and each region's offsets are read. That needs plain graphs: at tp > 1 (the
graphs hold tensor-parallel collectives) or on meta weights the counts are left out.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf


def expert_report(prog, batch: tuple | None = None) -> dict | None:
    """{"ep", "layers": [...]} for a program with expert regions, else None."""
    regions = [(c, r) for c in prog.chunks for r in c.experts]
    groups = [(c, g) for c in prog.chunks for g in getattr(c, "module_experts", ())]
    if not regions and not groups:
        return None
    ep = getattr(prog.plan, "ep", 1)
    counts, why = _tokens_per_expert(prog, batch)
    layers = []
    for chunk, r in regions:
        nodes = {n.name: n for n in chunk.gm.graph.nodes}
        rows = [nodes[x].meta["val"] for x in r["rows"]]
        outs = [nodes[x].meta["val"] for x in r["outputs"]]
        n_rows = int(rows[0].shape[0]) if rows else 0
        if outs and not r["offs"]:   # dense (passes/dense_experts.py): [E, T, out] (or [B, E, T, out] of
            # an einsum), every expert every token: the token slices, one per expert and token
            n_rows = int(outs[0].numel() // max(outs[0].shape[-1], 1))
        # dispatch: rows to experts; an input every expert reads whole (dims None) goes to each rank
        copies = [ep if r.get("dims", {}).get(x, 0) is None and ep > 1 else 1 for x in r["rows"]]
        there = sum(t.numel() * t.element_size() * c for t, c in zip(rows, copies))
        back = sum(t.numel() * t.element_size() for t in outs)     # combine: results home
        per = r["experts"] // ep
        layers.append({
            "layer": r["name"], "chunk": chunk.index, "experts": r["experts"],
            "experts_per_rank": per,
            "held_by_ep_rank": [[k * per, (k + 1) * per - 1] for k in range(ep)],
            "params": sorted(r["params"]),
            "rows_per_microbatch": n_rows,            # tokens x top-k of one rank's microbatch
            # all_to_all_single input bytes of one rank per microbatch (rows for its own
            # experts included); backward moves the same again, reversed
            "all_to_all_bytes": {"forward": there + back if ep > 1 else 0,
                                 "backward": there + back if ep > 1 else 0},
            # dense regions (no offsets): every expert sees every token
            "tokens_per_expert": counts.get(r["offs"] + f"@{chunk.index}") if r["offs"] else None,
        })
    layers += [_module_layer(chunk, g, ep) for chunk, g in groups]
    out = {"ep": ep, "layers": layers}
    if why:
        out["tokens_per_expert_missing"] = why
    return out


def _module_layer(chunk, g: dict, ep: int) -> dict:
    """Experts held as separate modules (passes/module_experts.py): each on one ep rank; one
    rank sends each expert its own inputs (a tensor every expert reads: once per ep rank)
    and gets every expert's result back (runtime/expert_modules.py)."""
    nodes = {n.name: n for n in chunk.gm.graph.nodes}

    def nbytes(name):
        t = nodes[name].meta["val"]
        return t.numel() * t.element_size()
    members = g["members"]
    there = 0
    for k in range(len(members[0]["inputs"])):
        names = {m["inputs"][k] for m in members}
        there += ep * nbytes(members[0]["inputs"][k]) if len(names) == 1 else sum(nbytes(x) for x in names)
    back = sum(nbytes(m["output"]) for m in members)
    per = g["experts"] // ep
    a2a = there + back if ep > 1 else 0
    return {"layer": g["name"], "chunk": chunk.index, "experts": g["experts"], "experts_per_rank": per,
            "held_by_ep_rank": [[k * per, (k + 1) * per - 1] for k in range(ep)], "params": sorted(g["owned"]),
            "rows_per_microbatch": None, "all_to_all_bytes": {"forward": a2a, "backward": a2a},
            "tokens_per_expert": None, "separate_modules": True}


def format_experts(report: dict) -> str:
    lines = [f"experts (ep={report['ep']}): layer, experts, per ep rank, rows/mb, all-to-all bytes "
             "per rank per microbatch (fwd+bwd), tokens per expert (example batch)"]
    for l in report["layers"]:
        a2a = l["all_to_all_bytes"]["forward"] + l["all_to_all_bytes"]["backward"]
        tokens = l["tokens_per_expert"]
        rows = l["rows_per_microbatch"]
        lines.append(f"  {l['layer']}  {l['experts']}  {l['experts_per_rank']}  {rows if rows is not None else '-'}  "
                     f"{a2a}  {tokens if tokens is not None else '-'}")
    if report.get("tokens_per_expert_missing"):
        lines.append(f"  (tokens per expert: {report['tokens_per_expert_missing']})")
    return "\n".join(lines)


def _tokens_per_expert(prog, batch):
    """{offsets node@chunk: [rows per expert]} summed over the example batch, and why not."""
    if batch is None:
        return {}, "no example batch"
    if prog.plan.tp > 1:
        return {}, "measured at tp=1 only (the graphs hold tensor-parallel collectives)"
    if getattr(prog, "is_meta", False):
        return {}, "the weights are on the meta device"
    parts = prog.plan.dp * prog.plan.microbatches
    wanted = {c.index: {r["offs"] for r in c.experts if r["offs"]} for c in prog.chunks}
    counts: dict[str, list[int]] = {}
    try:
        for k in range(parts):   # every dp rank's every microbatch
            inputs = _slice(batch, prog.batch_dims, parts, k)
            carried: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                for c in prog.chunks:
                    seen = _Reader(c.gm, wanted[c.index]).run_chunk(c, prog.state, inputs, carried)
                    for name, offs in seen.items():
                        ends = offs.to(torch.int64)
                        per = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
                        key = f"{name}@{c.index}"
                        counts[key] = [a + b for a, b in zip(counts.get(key, [0] * len(per)), per)]
    except Exception as exc:   # the report still shows the layout; say why counts are missing
        return {}, f"could not run the graphs on the example batch ({type(exc).__name__})"
    return counts, ""


def _slice(batch: tuple, dims, parts: int, k: int) -> tuple:
    out = []
    for t, d in zip(batch, dims or [0] * len(batch)):
        out.append(t if d is None or not isinstance(t, torch.Tensor) else t.chunk(parts, dim=d)[k])
    return tuple(out)


class _Reader(fx.Interpreter):
    """Runs one chunk graph and keeps the values of the offsets nodes it is asked for."""

    def __init__(self, gm, wanted: set[str]):
        super().__init__(gm)
        self.wanted, self.seen = wanted, {}

    def run_chunk(self, chunk, state, inputs, carried) -> dict:
        args = []
        for n in chunk.gm.graph.nodes:
            if n.op != "placeholder":
                continue
            kind = tf(n)["kind"]
            if kind == "boundary":
                args.append(carried[n.name])
            elif kind == "input":
                args.append(inputs[tf(n)["input_index"]])
            else:
                args.append(state[tf(n)["fqn"]])
        outs = self.run(*args)
        for name, v in zip(chunk.output_names, outs if isinstance(outs, (tuple, list)) else [outs]):
            carried[name] = v
        return self.seen

    def run_node(self, n):
        v = super().run_node(n)
        if n.name in self.wanted:
            self.seen[n.name] = v.detach().clone()
        return v
