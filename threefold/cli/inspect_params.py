"""`inspect --json`'s "parameters": how every parameter is laid out, read from the compiled
program (the chunk graphs' placeholders and their placement on the mesh, OnMesh; the
tensor-parallel pass's shard specs for padding, and its report of weights kept whole and
of fallbacks); nothing is decided again here.

One row per parameter: FQN, the chunks holding it (several for a tied one), full and local
(per tp rank) shape, placement (`S(d)` sharded along d, with blocks for fused projections
and the padded size of a padded vocabulary; `R` whole on every rank), the other mesh axes
that split it (`axes`, e.g. {"ep": "S(0)"}), frozen, and where it is kept whole or blocked
by a fallback, the pass's reason.
"""
from __future__ import annotations

from threefold.ir.program import tf
from threefold.placement import Shard, on_mesh_of


def parameter_rows(prog) -> list[dict]:
    tp = getattr(prog, "tp_report", None) or {}
    kept = tp.get("replicated_weights", {})
    blocked: dict[str, list[str]] = {}
    for fb in tp.get("fallbacks", []):
        for fqn in fb.get("blocked", []):
            blocked.setdefault(fqn, []).append(f"{fb['op']} in {fb['module']}: {fb['reason']}")
    rows: dict[str, dict] = {}
    for chunk in prog.chunks:
        for node in chunk.gm.graph.nodes:
            info = tf(node)
            if node.op != "placeholder" or info.get("kind") != "param":
                continue
            fqn = info["fqn"]
            if fqn in rows:
                rows[fqn]["chunks"].append(chunk.index)
                continue
            val = node.meta.get("val")
            full = prog.state.get(fqn)
            spec = prog.shard_fns.get(fqn)
            on = on_mesh_of(node)
            row = {"fqn": fqn, "chunks": [chunk.index],
                   "shape": list(full.shape) if full is not None else None,
                   "local_shape": list(val.shape) if val is not None else None,
                   "placement": _placement(on["tp"], spec, full), "frozen": bool(info.get("frozen", False))}
            axes = {a: str(p) for a, p in on.items if a != "tp"}
            if axes:   # the other mesh axes that split it (ep: its experts; zero=3: dp_shard rows)
                row["axes"] = axes
            if fqn in kept:
                row["kept_whole"] = kept[fqn]
            if fqn in blocked:
                row["fallbacks"] = blocked[fqn]
            rows[fqn] = row
    return list(rows.values())


def _placement(place, spec, full) -> str:
    """The tp placement's text, with what the shard spec adds: blocks every rank holds
    whole, the padded size."""
    if spec is None:
        return "R"
    dim, blocks = (place.dim, place.blocks) if isinstance(place, Shard) else (spec.dim, spec.blocks)
    text = f"S({dim}"
    if blocks:
        text += f",blocks={list(blocks)}"
        if any(spec.whole):   # blocks every rank holds whole (a fused projection's k/v head)
            text += f",whole={[b for b, w in zip(spec.blocks, spec.whole) if w]}"
    elif full is not None and spec.padded != full.shape[dim]:
        text += f",padded={spec.padded}"   # a vocabulary, heads or features padded to a multiple of tp
    return text + ")"
