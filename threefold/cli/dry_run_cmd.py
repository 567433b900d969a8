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

GIB = 2 ** 30


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


def prepare(spec: str, plan_text: str, world: int | None):
    """(workload, plan, program, sources, manifest) for a dry run."""
    # lazy: start-up: a command loads codegen.artifact only when it runs
    from threefold.codegen.artifact import build_manifest, build_sources
    # lazy: start-up: a command loads compiler.api only when it runs
    from threefold.compiler.api import compile_workload
    # lazy: start-up: a command loads plan_defaults only when it runs
    from threefold.plan_defaults import batch_rows, resolve_plan
    if world is not None and world < 1:
        raise PlanError(f"--world {world} is invalid: give the job's number of ranks, 1 or more")
    w = load_spec(spec)
    plan = resolve_plan(plan_text, world=world, batch=batch_rows(w.inputs, w.batch_dims)).plan
    if world is not None and plan.world_size != world:
        raise PlanError(f"plan {plan} needs {plan.world_size} ranks (the product of its mesh axes) but --world is "
                        f"{world}; change the plan or --world")
    prog = compile_workload(w, plan)
    sources = build_sources(prog)
    manifest = build_manifest(prog, sources, {}, with_weights=False)
    return w, plan, prog, sources, manifest


def dry_run(spec: str, plan_text: str, world: int | None = None, all_ranks: bool | None = None,
            cluster: str | None = None, progress=None) -> dict:
    """The dry run's report as a dict (what `--json` prints)."""

    # lazy: start-up: a command loads runtime.dry_run only when it runs
    from threefold.runtime.dry_run import DrySource, dry_run_job, meta_batch
    start = time.perf_counter()
    w, plan, prog, sources, manifest = prepare(spec, plan_text, world)
    compiled_s = time.perf_counter() - start
    capacity = None
    if cluster:
        # lazy: start-up: a command loads planner.cluster only when it runs
        from threefold.planner.cluster import load_cluster
        capacity = int(load_cluster(cluster).usable_bytes)
    batch = meta_batch(tuple(w.inputs) + ((w.target,) if w.target is not None else ()))
    report = dry_run_job(manifest, DrySource(sources), batch, all_ranks=all_ranks, capacity_bytes=capacity,
                         progress=progress)
    return summarize(report, prog, plan, compiled_s, capacity)


def summarize(report, prog, plan, compiled_s: float, capacity) -> dict:
    # lazy: start-up: a command loads planner.memory only when it runs
    from threefold.planner.memory import program_memory
    model = {m.rank: m for m in program_memory(prog)} if prog is not None else {}
    mesh = plan.mesh
    ranks = {}
    for r, run in sorted(report.runs.items()):
        entry = {"stage": mesh.coord(r).pp, "ops": len(run.ops), "groups_built": run.groups_built,
                 "groups_joined": run.groups_joined, "store_ops": run.store_ops, "memory": run.memory}
        if run.error:
            entry["error"] = run.error
        m = model.get(r)
        if m is not None:
            entry["memory_model"] = m.to_json()
            if run.peak_bytes:
                entry["memory_vs_model"] = run.peak_bytes / m.total - 1 if m.total else None
        ranks[r] = entry
    check = report.check
    return {"plan": str(plan), "world": report.world, "ok": report.ok, "rank_classes": report.classes,
            "ranks_run": len(report.runs), "compile_s": compiled_s, "dry_run_s": report.seconds,
            "groups_covered": check.groups, "group_comparisons": check.group_checks,
            "collective_calls": check.collectives, "p2p_pairs": check.pairs, "messages": check.messages,
            "mismatches": [str(m) for m in check.mismatches],
            "class_mismatches": [str(m) for m in report.class_mismatches],
            "errors": {str(r): e for r, e in report.errors.items()},
            "capacity_bytes": capacity, "over_capacity": report.too_big, "ranks": ranks}


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
    how = "one class per pipeline stage (2 witnesses each)" if out["rank_classes"] else "every rank"
    print(f"dry run of plan {out['plan']} at world {out['world']}: {out['ranks_run']} ranks run ({how}), "
          f"compile {out['compile_s']:.1f} s, dry run {out['dry_run_s']:.1f} s")
    print(f"  checked {out['groups_covered']} process groups ({out['group_comparisons']} distinct comparisons, "
          f"{out['collective_calls']} collective calls), {out['p2p_pairs']} send/receive pairs "
          f"({out['messages']} messages)")
    for r, e in out["errors"].items():
        print(f"  rank {r} failed: {e}")
    for m in out["class_mismatches"]:
        print(f"  CLASS: {m}")
    for m in out["mismatches"]:
        print(f"  MISMATCH: {m}")
    big = max((e["memory"].get("total", 0) for e in out["ranks"].values()), default=0) >= GIB
    unit, scale = ("GiB", GIB) if big else ("MiB", 2 ** 20)
    print(f"  rank  stage  groups(built/joined)  ops   params  grads  optim  activ  peak {unit}  model {unit}  diff")
    for r, e in out["ranks"].items():
        mem, model = e["memory"], e.get("memory_model", {})
        diff = e.get("memory_vs_model")
        print(f"  {r:>4}  {e['stage']:>5}  {e['groups_built']:>8}/{e['groups_joined']:<11} {e['ops']:>5}  "
              + "  ".join(f"{mem.get(k, 0) / scale:6.2f}" for k in ("params", "grads", "optimizer", "activations"))
              + f"  {mem.get('total', 0) / scale:8.2f}  {model.get('total', 0) / scale:9.2f}"
              + (f"  {diff:+.1%}" if diff is not None else ""))
    for t in out["over_capacity"]:
        print(f"  DOES NOT FIT: {t}")
    print("OK: every group agrees and every send has its receive" if out["ok"] else "FAILED")
