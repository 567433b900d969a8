"""`threefold plan SPEC ... --verify K`: dry-run the K best plans (cli/dry_run_cmd.py) and
drop those whose dry run fails (a group's members disagree, a send has no receive, a rank
fails to assemble or step, or a rank does not fit the cluster's GPU memory)."""
from __future__ import annotations

import sys

from threefold.errors import PlanError


def add_flag(p) -> None:
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="dry-run the K best plans of SPEC at full world size (threefold check --dry-run) "
                        "and drop those that fail")


def verify_plans(args, plans: list) -> list:
    """`plans` (best first) less those of the first K whose dry run fails; each verdict on stderr."""
    k = args.verify
    if k < 0:
        raise PlanError(f"--verify {k} is invalid: give how many of the best plans to dry-run (0: none)")
    if not k:
        return plans
    if not args.spec:
        raise PlanError("--verify dry-runs the plans of a workload: give a SPEC (path/to/file.py:factory)")
    # lazy: start-up: a command loads cli.dry_run_cmd only when it runs
    from threefold.cli.dry_run_cmd import dry_run
    kept = []
    for e in plans[:k]:
        plan = str(e.config.plan)
        try:
            out = dry_run(args.spec, plan, args.gpus, cluster=args.cluster)
            why = next(iter(out["mismatches"] + out["class_mismatches"] + list(out["errors"].values())
                            + out["over_capacity"]), None)
        except PlanError as exc:
            why = str(exc)
        if why is None:
            kept.append(e)
            print(f"threefold plan: verified {plan}: {out['groups_covered']} groups and {out['p2p_pairs']} "
                  f"send/receive pairs agree ({out['dry_run_s']:.0f} s dry run)", file=sys.stderr)
        else:
            print(f"threefold plan: dropped {plan}: {why}", file=sys.stderr)
    return kept + plans[k:]
