"""What the tensor-parallel pass did, for `inspect` and tests: the share of parameters that
are sharded, every fallback (op, module, bytes moved per step), and which projections were
kept whole and why. When tp > 1 leaves over half of the parameters replicated, say so."""
from __future__ import annotations

from threefold.ir.program import tf


def tp_report(rw) -> dict:
    prog = rw.prog
    params = {tf(n)["fqn"] for n in prog.graph.nodes
              if n.op == "placeholder" and tf(n).get("kind") == "param"}
    total = sum(int(prog.state[f].numel()) for f in params if f in prog.state)
    sharded = sum(_sharded_numel(rw, f) for f in rw.decisions if f in prog.state)
    return {"tp": rw.t, "params": total, "sharded_params": sharded,
            "sharded_share": round(sharded / total, 4) if total else 0.0,
            "fallbacks": [{"op": fb.op, "node": fb.node, "module": fb.module, "reason": fb.why,
                           "bytes_per_step": fb.bytes_per_step, "blocked": blocked}
                          for fb, blocked in zip(rw.fallbacks, rw.fallback_blocked)],
            "replicated_weights": dict(sorted(rw.replicated_weights.items()))}


def report_notes(rep: dict) -> list[str]:
    """The notes of a report (each fallback's note is the sharding walker's, `fallback_note`)."""
    notes = [f"tp={rep['tp']}: {rep['sharded_share']:.0%} of parameters sharded "
             f"({rep['sharded_params']} of {rep['params']})"]
    for fqn, reason in rep["replicated_weights"].items():
        notes.append(f"tp: {fqn} kept whole on every rank: {reason}")
    if rep["params"] and rep["sharded_share"] < 0.5:
        why = sorted({f"{fb['op']} in {fb['module']}" for fb in rep["fallbacks"]})
        kept = [f"{fqn} ({reason})" for fqn, reason in rep["replicated_weights"].items()]
        notes.append(f"warning: tp={rep['tp']} leaves {1 - rep['sharded_share']:.0%} of parameters replicated; "
                     + ("kept whole: " + ", ".join(kept[:6]) + ("..." if len(kept) > 6 else "") if kept else
                        "no parameter matmul was recognised as column- or row-parallel")
                     + ("; ops without a sharded rule: " + ", ".join(why[:6]) if why else ""))
    return notes


def _sharded_numel(rw, fqn: str) -> int:
    """Elements of a parameter that are split over tp (blocks held whole do not count)."""
    numel = int(rw.prog.state[fqn].numel())
    whole = rw.whole_blocks.get(fqn)
    if not whole:
        return numel
    blocks = rw.decisions[fqn][1]
    return numel * sum(b for b, w in zip(blocks, whole) if not w) // sum(blocks)
