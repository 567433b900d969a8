"""`threefold check SPEC --plan P --dry-run --world N`: the whole job before the cluster.

Every rank of a world of N ranks that do not exist is assembled from the compiled program
as a real job assembles it, on torch's fake process-group backend and meta tensors, and
runs one training step (forward, backward, every collective, the optimizer) without data
(runtime/dry_run.py). What each rank issued is cross-checked over the whole job
(runtime/dry_check.py): every process group's members issue the same collectives in the
same order and shapes, every send has its receive. Each rank's memory at the step's peak
is compared with the memory model (planner/memory.py, `inspect --memory`) and, with
`--cluster`, with the device's capacity. Exit 0 when everything agrees and fits, 1 when
not (each mismatch names both ranks, the group, the op index and both calls).
"""
from __future__ import annotations

import sys
import time

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.workload import load_spec



def add_flags(p) -> None:
    g = p.add_argument_group("dry run (no ranks are started)")
    g.add_argument("--dry-run", action="store_true",
                   help="dry-run every rank of the job at full world size on a fake process group and meta "
                        "tensors, one training step; cross-check every group's collectives and every send's receive")
    g.add_argument("--world", type=int, help="with --dry-run: the job's ranks (dp is filled in from it)")
    g.add_argument("--all-ranks", action="store_true",
                   help="with --dry-run: run every rank, not one class per pipeline stage "
                        "(the default above 64 ranks)")
    g.add_argument("--cluster", metavar="NAME|TOML",
                   help="with --dry-run: name every rank whose step does not fit this cluster's GPU memory")


def dry_run(spec: str, plan_text: str, world: int | None = None, all_ranks: bool | None = None,
            cluster: str | None = None, progress=None) -> dict:
    """The dry run's report as a dict (what `--json` prints)."""
    # lazy: start-up: a command loads the dry run and the SPEC loader only when it runs
    from threefold.dry_run import dry_run_workload
    if world is not None and world < 1:
        raise PlanError(f"--world {world} is invalid: give the job's number of ranks, 1 or more")
    return dry_run_workload(load_spec(spec), plan_text, world, all_ranks, cluster, progress).summary


def run(args) -> int:
    out = dry_run(args.spec, args.plan, args.world, True if args.all_ranks else None, args.cluster,
                  progress=None if args.json else _progress)
    if args.json:
        print(dumps(out))
    else:
        print_report(out)
    return 0 if out["ok"] else 1


def _progress(i: int, n: int, run) -> None:
    if i == n or i % 16 == 0:
        print(f"dry run: {i}/{n} ranks", file=sys.stderr)


def print_report(out: dict) -> None:
    # lazy: start-up: threefold.dry_run loads 1 more modules only when this runs
    from threefold.dry_run import report_text
    print(report_text(out))
