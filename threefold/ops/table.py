"""The op table a user can read (`threefold ops`): every op the compiler knows by name, its
family (families.py) and, per axis, how it is split or why it is not. Read from the
registries themselves (the tp rules' ops/rules.Registry, passes/cp_rules, ep's passes/ep_rules), so it cannot drift."""
from __future__ import annotations

from threefold.ops import families as fam
from threefold.passes import cp_rules
from threefold.passes.ep_rules import EP as EP_REGISTRY
from threefold.passes.tp_rules import REGISTRY as TP_REGISTRY

AXES = ("tp", "cp", "ep")


def _tp(name: str) -> str:
    rule = TP_REGISTRY.lookup(name)
    if callable(rule):
        return f"rule {getattr(rule, '__name__', 'lambda').lstrip('_')}"
    if fam.family(name) in ("matmul", "embedding"):   # the pass's parameter rewrites (tp_weights.py)
        return "split by its weight (column/row or vocab parallel) where one is a parameter, else replicated around it"
    return "replicated around it (inputs gathered, no sharded rule)"


def _cp(name: str) -> str:
    d = cp_rules.decision_for(name)
    if isinstance(d, str):
        return ("all-gather fallback: " if fam.family(name) in cp_rules.GATHERABLE else "refused: ") + d
    where = " (all-gather fallback along the sequence)" if fam.family(name) in cp_rules.GATHERABLE else ""
    return f"rule {d.__name__.lstrip('_')}{where}"


def _ep(name: str) -> str:
    """Between the expert matmuls of an expert region (passes/ep_rules.py); outside one an op
    runs on the token's own rank, as under dp."""
    rule = EP_REGISTRY.lookup(name)
    if callable(rule):
        return f"rule {rule.__name__.lstrip('_')}: " + (rule.__doc__ or "").strip().split("\n")[0]
    return "rule row_wise: kept in an expert region where the batch-row rules keep each row in place on dim 0"


def op_table() -> list[dict]:
    """One row per op name: {op, family, tp, cp, ep}, sorted by family then name."""
    names = TP_REGISTRY.names() | set(cp_rules.RULES) | set(cp_rules.REFUSALS) | fam.pointwise_names() \
        | {n for names in fam.FAMILIES.values() for n in names} | EP_REGISTRY.names()
    rows = [{"op": n, "family": fam.family(n) or "-", "tp": _tp(n), "cp": _cp(n), "ep": _ep(n)} for n in names]
    return sorted(rows, key=lambda r: (r["family"], r["op"]))
