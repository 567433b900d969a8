"""One line naming every fallback a plan pays for, printed once when a job starts.

The passes record what they could not do the fast way: a projection tensor parallelism
keeps whole on every rank (its heads do not divide), a shard padded to divide, an op run on
all-gathered inputs (tp or cp), a pipeline cut inside a layer. Each is correct, but costs
memory or speed, and `inspect` alone used to show them: `parallelize`, `check` and `train`
now print this line, with the share each costs and the command that shows the details.
"""
from __future__ import annotations

import os
import sys

from threefold.cli.units import human_bytes


def fallback_costs(prog) -> list[str]:
    """The fallbacks of a compiled program, each with what it costs (empty: none)."""
    items: list[str] = []
    rep = getattr(prog, "tp_report", None) or {}
    state = prog.state
    total = sum(int(t.numel()) for k, t in state.items() if not k.startswith("_const.")) or 1
    kept = rep.get("replicated_weights") or {}
    if kept:
        numel = sum(int(state[f].numel()) for f in kept if f in state)
        items.append(f"{numel / total:.0%} of parameters kept whole on every tp rank ({len(kept)} weight"
                     f"{'s' if len(kept) != 1 else ''}: {_names(kept)})")
    shards = getattr(prog, "shard_fns", None) or {}
    extra = 0
    padded = []
    for fqn, spec in shards.items():
        if fqn in state and not spec.blocks and spec.padded != state[fqn].shape[spec.dim]:
            t = state[fqn]
            extra += (spec.padded - t.shape[spec.dim]) * t.numel() // max(1, t.shape[spec.dim])
            padded.append(fqn)
    if padded:
        items.append(f"{len(padded)} weight{'s' if len(padded) != 1 else ''} padded to divide by tp "
                     f"(+{_pct(extra / total)} of parameter memory: {_names(padded)})")
    tp_falls = rep.get("fallbacks") or []
    if tp_falls:
        moved = sum(int(f.get("bytes_per_step") or 0) for f in tp_falls)
        items.append(f"{len(tp_falls)} op{'s' if len(tp_falls) != 1 else ''} run on all-gathered tp inputs "
                     f"({_bytes(moved)}/step per rank: {_names([f['op'] for f in tp_falls])})")
    cp_falls = [n for n in prog.notes if n.startswith("cp fallback:")]
    if cp_falls:
        items.append(f"{len(cp_falls)} op{'s' if len(cp_falls) != 1 else ''} run on the all-gathered sequence (cp)")
    items += [n for n in prog.notes if n.startswith("pipeline cut inside a layer")]
    return items


def fallback_line(prog, inspect_command: str) -> str:
    """'' or one line: every fallback with its cost, and the command that shows them."""
    items = fallback_costs(prog)
    if not items:
        return ""
    return f"threefold: plan {prog.plan} falls back: " + "; ".join(items) + f" (details: {inspect_command})"


def _names(values, limit: int = 3) -> str:
    short = sorted({str(v).rsplit(".", 2)[-2] if str(v).count(".") >= 2 else str(v) for v in values})
    return ", ".join(short[:limit]) + (", ..." if len(short) > limit else "")


def _pct(x: float) -> str:
    return f"{x:.1%}" if x >= 0.001 else "<0.1%"


def _bytes(x: float) -> str:
    return human_bytes(x)


SHOWN_ENV = "THREEFOLD_FALLBACKS_SHOWN"   # set by a command that printed the line: its ranks do not repeat it


def show_fallbacks(prog, inspect_command: str, mark: bool = False) -> None:
    """Print the fallback line on stderr, once per job: a command's parent prints it and
    (`mark`) marks the environment its ranks inherit, so their parallelize stays quiet."""
    if os.environ.get(SHOWN_ENV) == "1":
        return
    line = fallback_line(prog, inspect_command)
    if line:
        print(line, file=sys.stderr, flush=True)
    if mark:
        os.environ[SHOWN_ENV] = "1"
