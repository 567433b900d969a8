"""A whole job's dry run from a workload: compile it for the plan at its world size, run
every rank on torch's fake process group and meta tensors (runtime/dry_run.py), cross-check
what the ranks issued (runtime/dry_check.py, runtime/dry_order.py), and compare each rank's
memory with the memory model (planner/memory.py). Shared by `threefold check --dry-run`
(cli/dry_run_cmd.py) and `parallelize(..., dry_run=True)` (api.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from threefold.errors import PlanError
from threefold.plan_defaults import batch_rows, resolve_plan
from threefold.runtime.dry_run import DrySource, dry_run_job, meta_batch


@dataclass
class DryRunReport:
    """What `parallelize(model, plan, inputs, ..., dry_run=True, world=N)` returns.

    `ok`: every group agrees, every send has its receive, no deadlock, every rank fits;
    `summary`: the report as `threefold check --dry-run --json` prints it (per rank: its
    collectives and p2p count, groups built/joined, store calls, memory by category and
    the memory model's); `job`: the runtime's JobReport (each rank run's ordered CommOps in
    `job.runs[r].ops`, the cross-check in `job.check`). `str(report)` is the CLI's text."""
    summary: dict
    job: object

    @property
    def ok(self) -> bool:
        return bool(self.summary["ok"])

    @property
    def world(self) -> int:
        return self.summary["world"]

    @property
    def mismatches(self) -> list[str]:
        return list(self.summary["mismatches"]) + list(self.summary["class_mismatches"])

    def memory(self, rank: int) -> dict[str, int]:
        """Bytes by category at `rank`'s step peak (a rank run, or its class's witness)."""
        run = self.job.runs.get(rank)
        if run is None:
            raise KeyError(f"rank {rank} was not run (ranks run: {sorted(self.job.runs)[:8]}...); "
                           "pass all_ranks=True to run every rank")
        return dict(run.memory)

    def collectives(self, rank: int) -> list[str]:
        """`rank`'s collectives and p2p operations in issue order, as text."""
        return [op.describe() for op in self.job.runs[rank].ops]

    def __str__(self) -> str:
        return report_text(self.summary)


def dry_run_workload(workload, plan, world: int | None = None, all_ranks: bool | None = None,
                     cluster: str | None = None, progress=None) -> DryRunReport:
    """The dry run of `workload` (a threefold.Workload) under `plan` (text or Plan; dp is
    filled in from `world`)."""
    # lazy: start-up: threefold.codegen.artifact loads 27 more modules only when this runs
    from threefold.codegen.artifact import build_manifest, build_sources
    # lazy: start-up: threefold.compiler.api loads 74 more modules only when this runs
    from threefold.compiler.api import compile_workload
    if world is not None and (not isinstance(world, int) or world < 1):
        raise PlanError(f"world={world!r} is invalid: give the job's number of ranks, 1 or more")
    start = time.perf_counter()
    plan = resolve_plan(plan, world=world, batch=batch_rows(workload.inputs, workload.batch_dims)).plan
    if world is not None and plan.world_size != world:
        raise PlanError(f"plan {plan} needs {plan.world_size} ranks (the product of its mesh axes) but the world is "
                        f"{world}; change the plan or the world (--world)")
    prog = compile_workload(workload, plan)
    sources = build_sources(prog)
    manifest = build_manifest(prog, sources, {}, with_weights=False)
    compiled_s = time.perf_counter() - start
    capacity = None
    if cluster:
        # lazy: start-up: the planner loads only with --cluster
        from threefold.planner.cluster import load_cluster
        capacity = int(load_cluster(cluster).usable_bytes)
    batch = meta_batch(tuple(workload.inputs) + ((workload.target,) if workload.target is not None else ()))
    job = dry_run_job(manifest, DrySource(sources), batch, all_ranks=all_ranks, capacity_bytes=capacity,
                      progress=progress)
    return DryRunReport(summarize(job, prog, plan, compiled_s, capacity), job)


def summarize(report, prog, plan, compiled_s: float, capacity) -> dict:
    """The JSON summary of a JobReport (see DryRunReport)."""
    # lazy: start-up: threefold.planner.memory loads 5 more modules only when this runs
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
            if run.peak_bytes:   # against the model's step peak (planner/memory.py: `peak`)
                entry["memory_vs_model"] = run.peak_bytes / m.peak - 1 if m.peak else None
        ranks[r] = entry
    check = report.check
    return {"plan": str(plan), "world": report.world, "ok": report.ok, "rank_classes": report.classes,
            "ranks_run": len(report.runs), "compile_s": compiled_s, "dry_run_s": report.seconds,
            "groups_covered": check.groups, "group_comparisons": check.group_checks,
            "collective_calls": check.collectives, "p2p_pairs": check.pairs, "messages": check.messages,
            "mismatches": [str(m) for m in check.mismatches] + ([str(check.deadlock)] if check.deadlock else []),
            "class_mismatches": [str(m) for m in report.class_mismatches],
            "errors": {str(r): e for r, e in report.errors.items()},
            "capacity_bytes": capacity, "over_capacity": report.too_big, "ranks": ranks}


GIB = 2 ** 30


def report_text(out: dict) -> str:
    """The report as text (the CLI's, and str() of parallelize(dry_run=True)'s report)."""
    lines: list[str] = []
    add = lines.append
    how = "one class per pipeline stage (2 witnesses each)" if out["rank_classes"] else "every rank"
    add(f"dry run of plan {out['plan']} at world {out['world']}: {out['ranks_run']} ranks run ({how}), "
          f"compile {out['compile_s']:.1f} s, dry run {out['dry_run_s']:.1f} s")
    add(f"  checked {out['groups_covered']} process groups ({out['group_comparisons']} distinct comparisons, "
          f"{out['collective_calls']} collective calls), {out['p2p_pairs']} send/receive pairs "
          f"({out['messages']} messages)")
    for r, e in out["errors"].items():
        add(f"  rank {r} failed: {e}")
    for m in out["class_mismatches"]:
        add(f"  CLASS: {m}")
    for m in out["mismatches"]:
        add(f"  MISMATCH: {m}")
    big = max((e["memory"].get("total", 0) for e in out["ranks"].values()), default=0) >= GIB
    unit, scale = ("GiB", GIB) if big else ("MiB", 2 ** 20)
    add(f"  rank  stage  groups(built/joined)  ops  store  params  grads  optim  activ  comm  peak {unit}  "
          f"model {unit}  diff")
    for r, e in out["ranks"].items():
        mem, model = e["memory"], e.get("memory_model", {})
        diff = e.get("memory_vs_model")
        add(f"  {r:>4}  {e['stage']:>5}  {e['groups_built']:>8}/{e['groups_joined']:<11} {e['ops']:>5}  "
              f"{sum(e['store_ops'].values()):>5}  "
              + "  ".join(f"{mem.get(k, 0) / scale:6.2f}" for k in ("params", "grads", "optimizer", "activations",
                                                                    "buffers"))
              + f"  {mem.get('total', 0) / scale:8.2f}  {model.get('peak', 0) / scale:9.2f}"
              + (f"  {diff:+.1%}" if diff is not None else ""))
    for t in out["over_capacity"]:
        add(f"  DOES NOT FIT: {t}")
    add("OK: every group agrees and every send has its receive" if out["ok"] else "FAILED")
    return "\n".join(lines)
