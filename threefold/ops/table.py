"""The op table a user can read (`threefold ops`): every op the compiler knows by name, its
family (families.py) and, per axis, how it is split or why it is not. Read from the
registries themselves (passes/tp_rules.RULES, passes/cp_rules), so it cannot drift."""
from __future__ import annotations

from threefold.ops import families as fam

AXES = ("tp", "cp")


def _tp(name: str) -> str:
    from threefold.passes.tp_rules import RULES   # lazy: start-up: passes.tp_rules loads only on this path
    rule = RULES.get(name) or (RULES.get(name[:-1]) if name.endswith("_") else None)
    if rule is not None:
        return f"rule {getattr(rule, '__name__', 'lambda').lstrip('_')}"
    return "replicated around it (inputs gathered, no sharded rule)"


def _cp(name: str) -> str:
    # lazy: start-up: passes.cp_rules loads only on this path
    from threefold.passes.cp_rules import GATHERABLE, decision_for
    d = decision_for(name)
    if isinstance(d, str):
        return ("all-gather fallback: " if fam.family(name) in GATHERABLE else "refused: ") + d
    where = " (all-gather fallback along the sequence)" if fam.family(name) in GATHERABLE else ""
    return f"rule {d.__name__.lstrip('_')}{where}"


def op_table() -> list[dict]:
    """One row per op name: {op, family, tp, cp}, sorted by family then name."""
    # lazy: start-up: passes.cp_rules loads only on this path
    from threefold.passes.cp_rules import REFUSALS, RULES as CP_RULES
    # lazy: start-up: passes.tp_rules loads only on this path
    from threefold.passes.tp_rules import RULES as TP_RULES
    names = set(TP_RULES) | set(CP_RULES) | set(REFUSALS) | {n for names in fam.FAMILIES.values() for n in names}
    rows = [{"op": n, "family": fam.family(n) or "-", "tp": _tp(n), "cp": _cp(n)} for n in names]
    return sorted(rows, key=lambda r: (r["family"], r["op"]))
