"""`threefold ops [--axis tp|cp|ep] [--json]`: the op table, per axis, from the rule registries."""
from __future__ import annotations

from threefold.cli.jsonout import dumps


def register(sub) -> None:
    p = sub.add_parser(
        "ops", help="list the ATen ops the compiler knows and how each axis splits them",
        description="Every op with a family or a rule (threefold/ops/families.py, the tp and cp rule "
        "and ep registries): its family and, per axis, the rule that splits it, the fallback it takes "
        "(tp: replicated around it; cp: the sequence all-gathered around it, listed by inspect, a "
        "PlanError under strict=true) or why it is refused.")
    p.add_argument("--axis", choices=["tp", "cp", "ep"], default=None, help="show one axis only")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: start-up: a command loads ops.table only when it runs
    from threefold.ops.table import AXES, op_table
    axes = [args.axis] if args.axis else list(AXES)
    rows = [{k: r[k] for k in ("op", "family", *axes)} for r in op_table()]
    if args.json:
        print(dumps(rows))
        return 0
    width = max(len(r["op"]) for r in rows)
    fam_width = max(len(r["family"]) for r in rows)
    print(f"{'op':<{width}}  {'family':<{fam_width}}  " + "  |  ".join(axes))
    for r in rows:
        print(f"{r['op']:<{width}}  {r['family']:<{fam_width}}  " + "  |  ".join(r[a] for a in axes))
    return 0
