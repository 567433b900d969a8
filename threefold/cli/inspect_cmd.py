"""`threefold inspect SPEC --plan PLAN`: how the compiler cuts a model, chunk by chunk.

Prints one row per pipeline chunk (its ranks, ops, parameters, forward FLOPs, activation
bytes kept for backward, boundary bytes received and sent) and the FLOPs imbalance
(max/mean over chunks; 1.00 is perfect). Under tp > 1: the share of parameters sharded,
projections kept whole and why, and every sharding fallback (op, module, bytes per step). `--graph` adds each chunk's graph, `--json` prints
one JSON object instead (with "parameters": every parameter's placement and local shape,
cli/inspect_params.py). `--html FILE` writes all of it, the memory model, the schedule
timeline and the generated code as one self-contained page (threefold/report/).
"""
from __future__ import annotations

import json
import sys

from threefold.cli.units import human, human_bytes
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.runtime.mesh import chunk_layout, stage_of
from threefold.workload import load_spec


def register(sub) -> None:
    p = sub.add_parser(
        "inspect", help="compile a workload for a plan and show its pipeline chunks",
        description="Trace the workload (at microbatch size), run the compiler passes for PLAN "
        "and print a table per chunk: ranks, ops, params, forward FLOPs, activation bytes, "
        "boundary bytes in and out (all per tp rank), then the FLOPs imbalance (max/mean). "
        "Nothing is written, except the page --html asks for.")
    p.add_argument("spec", metavar="SPEC", help="workload: path/to/file.py:factory or pkg.module:factory")
    p.add_argument("--plan", default="", help="e.g. 'pp=4' or 'pp=2,v=2,schedule=interleaved' (default: one chunk; m left out: 2*pp)")
    p.add_argument("--graph", action="store_true", help="also print each chunk's graph")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--memory", action="store_true",
                   help="also print the memory model per rank: params, gathered (zero=3's working set), "
                        "grads, optimizer (AdamW; zero>=1 shards it over dp_shard), activations over the "
                        "schedule, recompute, buffers (planner/memory.py)")
    p.add_argument("--cluster", metavar="NAME|TOML",
                   help="with --memory: say whether every rank fits a GPU of this cluster preset or file "
                        "(exit 1 when one does not)")
    p.add_argument("--html", metavar="FILE",
                   help="write one self-contained HTML page (no network): the chunk table, every parameter's "
                        "sharding, collectives per chunk, memory per rank, the schedule timeline, the generated "
                        "code of each chunk, and a search box over parameters and ops")
    p.add_argument("--trace", metavar="FILE",
                   help="with --html: add the measured timeline of a trace.json from `threefold train --trace`")
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: start-up: a command loads compiler.api only when it runs
    from threefold.compiler.api import compile_workload
    html, trace = getattr(args, "html", None), _read_trace(getattr(args, "trace", None), getattr(args, "html", None))
    if html:
        # lazy: start-up: a command loads outdir only when it runs
        from threefold.outdir import check_out_file
        check_out_file(html, "--html")    # a bad path fails before compiling
    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import command_plan, tell
    # lazy: start-up: a command loads plan_defaults only when it runs
    from threefold.plan_defaults import batch_rows
    workload = load_spec(args.spec)
    resolved = command_plan(args.plan, batch=batch_rows(workload.inputs, workload.batch_dims))   # m filled in
    from threefold.cli.phases import Phases   # lazy: start-up: a command loads cli.phases only when it runs
    with Phases("inspect", enabled=not getattr(args, "json", False)) as progress:
        prog = compile_workload(workload, resolved.plan, progress=progress)
    tell(resolved)
    report = chunk_report(prog)
    # lazy: start-up: a command loads cli.inspect_experts only when it runs
    from threefold.cli.inspect_experts import expert_report, format_experts
    experts = expert_report(prog, tuple(workload.inputs) + ((workload.target,) if workload.loss_fn else ()))
    if experts is not None:   # MoE layers: experts per ep rank, tokens per expert, all-to-all bytes
        report["experts"] = experts
    # lazy: start-up: a command loads cli.step_report only when it runs
    from threefold.cli.step_report import step_report
    report.update(step_report(prog))
    memory = None
    if html:
        write_html(prog, report, html, trace)
        print(f"report written to {html}")
        return 0
    if getattr(args, "memory", False):
        # lazy: start-up: a command loads planner.memory only when it runs
        from threefold.planner.memory import program_memory
        memory = [r.to_json() for r in program_memory(prog)]
        report["memory"] = memory
        if getattr(args, "cluster", None):
            # lazy: start-up: a command loads planner.cluster only when it runs
            from threefold.planner.cluster import load_cluster
            cluster = load_cluster(args.cluster)
            worst = max(memory, key=lambda r: r["total"])
            report["fits"] = {"cluster": cluster.name, "usable_bytes": int(cluster.usable_bytes),
                              "largest_rank": worst["rank"], "largest_bytes": worst["total"],
                              "fits": worst["total"] <= cluster.usable_bytes}
    if args.json:
        if args.graph:
            # lazy: start-up: a command loads ir.program only when it runs
            from threefold.ir.program import format_chunk
            for row, chunk in zip(report["chunks"], prog.chunks):
                row["graph"] = format_chunk(chunk)
        print(json.dumps(report, indent=2))
        return 0 if report.get("fits", {}).get("fits", True) else 1
    print(format_report(prog, {k: v for k, v in report.items() if k != "memory"}))
    if experts is not None:
        print()
        print(format_experts(experts))
    if getattr(args, "memory", False):
        print()
        print_memory(prog, memory)
        fit = report.get("fits")
        if fit:
            print(f"fits {fit['cluster']}: {'yes' if fit['fits'] else 'NO'} (largest: rank "
                  f"{fit['largest_rank']} {human_bytes(fit['largest_bytes'])} of {human_bytes(fit['usable_bytes'])} usable)")
    if args.graph:
        # lazy: start-up: a command loads ir.program only when it runs
        from threefold.ir.program import format_chunk
        for chunk in prog.chunks:
            print()
            print(format_chunk(chunk))
    return 0 if report.get("fits", {}).get("fits", True) else 1


def _read_trace(path: str | None, html: str | None) -> dict | None:
    """--trace FILE: a trace.json of `threefold train --trace` (checked to be one)."""
    if path is None:
        return None
    if not html:
        raise PlanError("--trace needs --html FILE: the measured timeline is drawn on the HTML page")
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise PlanError(f"--trace {path!r} cannot be read as JSON ({exc}); give the trace.json "
                        "`threefold train --trace` wrote") from None
    if not isinstance(trace, dict) or "traceEvents" not in trace or "schedule" not in trace.get("otherData", {}):
        raise PlanError(f"--trace {path!r} is not a threefold trace (no traceEvents and otherData.schedule); "
                        "give the trace.json `threefold train --trace` wrote")
    return trace


def write_html(prog, report: dict, path: str, trace: dict | None = None) -> None:
    """The --html page from inspect's own data: this report, the memory model, the generated
    sources and the schedule simulated with the chunks' FLOPs (threefold/report/)."""
    # lazy: start-up: a command loads codegen.artifact only when it runs
    from threefold.codegen.artifact import build_sources
    # lazy: start-up: a command loads outdir only when it runs
    from threefold.outdir import write_file_atomically
    # lazy: start-up: a command loads planner.memory only when it runs
    from threefold.planner.memory import program_memory
    # lazy: start-up: a command loads report.inspect_page only when it runs
    from threefold.report.inspect_page import inspect_html
    memory = [r.to_json() for r in program_memory(prog)]
    if trace is not None and trace["otherData"].get("plan") != str(prog.plan):
        raise PlanError(f"--trace was recorded under plan {trace['otherData'].get('plan')}, not {prog.plan}; "
                        "inspect with the plan the trace ran")
    write_file_atomically(path, inspect_html(prog.name, report, memory, build_sources(prog),
                                             schedule_svg(prog, report), trace))


def schedule_svg(prog, report: dict) -> str:
    """The plan's schedule simulated with each chunk's forward FLOPs (GFLOP) as its forward
    time and twice that as its backward (runtime/simulate.py, drawn by timeline_svg.py)."""
    # lazy: start-up: a command loads runtime.schedule only when it runs
    from threefold.runtime.schedule import make_schedule
    # lazy: start-up: a command loads runtime.simulate only when it runs
    from threefold.runtime.simulate import simulate
    # lazy: start-up: a command loads runtime.timeline_svg only when it runs
    from threefold.runtime.timeline_svg import render_svg
    plan = prog.plan
    schedule = make_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    times = {c["index"]: (c["flops"] / 1e9, 2 * c["flops"] / 1e9) for c in report["chunks"]}
    sim = simulate(schedule, times)
    return render_svg(sim, title=f"{plan.schedule} pp={plan.pp} m={plan.microbatches} v={plan.interleave}: "
                                 f"time in GFLOP of forward, bubble {sim.bubble_fraction:.1%} of rank-time")


def chunk_ranks(plan: Plan, index: int) -> list[int]:
    """Global ranks that run chunk `index` (Megatron layout: tp fastest, then dp, then pp)."""
    return plan.mesh.stage_ranks(stage_of(index, plan.pp, chunk_layout(plan.schedule)))


def chunk_report(prog) -> dict:
    """The `inspect --json` object: {"plan", "chunks": [...], "imbalance"}."""
    # lazy: start-up: a command loads compiler.collectives only when it runs
    from threefold.compiler.collectives import chunk_collectives
    # lazy: start-up: a command loads passes.cost only when it runs
    from threefold.passes.cost import chunk_costs, imbalance
    costs = chunk_costs(prog)
    collectives = chunk_collectives(prog)
    plan = prog.plan
    chunks = [{
        "index": chunk.index,
        "stage": stage_of(chunk.index, plan.pp, chunk_layout(plan.schedule)),
        "ranks": chunk_ranks(plan, chunk.index),
        "ops": c.ops,
        "params": c.params,
        "flops": c.flops,
        "activation_bytes": c.activation_bytes,
        "boundary_in_bytes": c.boundary_in_bytes,
        "boundary_out_bytes": c.boundary_out_bytes,
        "collectives": colls,
    } for chunk, c, colls in zip(prog.chunks, costs, collectives)]
    # lazy: start-up: a command loads cli.inspect_params only when it runs
    from threefold.cli.inspect_params import parameter_rows
    report = {"plan": str(plan), "chunks": chunks,
              "imbalance": round(imbalance([c.flops for c in costs]), 6),
              "parameters": parameter_rows(prog)}
    if getattr(prog, "tp_report", None) is not None:   # tp > 1: sharded share, fallbacks
        report["tensor_parallel"] = prog.tp_report
    if getattr(plan, "recompute", "none") != "none":   # passes/recompute.py: what backward reruns
        report["recompute"] = {"mode": plan.recompute, "chunks": [
            [{"segment": seg["name"], "ops": len(seg["nodes"]), "why": seg["why"]}
             for seg in chunk.recompute]
            for chunk in prog.chunks]}
    return report


def format_report(prog, report: dict) -> str:
    headers = ["chunk", "stage", "ranks", "ops", "params", "fwd FLOPs", "activations",
               "boundary in", "boundary out", "tp collectives/mb"]
    rows = [[str(r["index"]), str(r["stage"]), _ranks(r["ranks"]), str(r["ops"]),
             human(r["params"]), human(r["flops"]), human_bytes(r["activation_bytes"]),
             human_bytes(r["boundary_in_bytes"]), human_bytes(r["boundary_out_bytes"]),
             _tp_collectives(r["collectives"])]
            for r in report["chunks"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    per_rank = "; figures per tp rank" if prog.plan.tp > 1 else ""
    lines = [f"{prog.name}  plan: {report['plan']}  ({len(rows)} chunks{per_rank})"]
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    total = sum(r["flops"] for r in report["chunks"])
    lines.append(f"FLOPs imbalance (max/mean): {report['imbalance']:.3f}   total forward FLOPs: {human(total)}")
    if prog.ties:
        shared = [fqn for fqn in prog.ties if sum(fqn in c.params for c in prog.chunks) > 1]
        if shared:
            lines.append(f"tied parameters held by several chunks (grads summed): {', '.join(shared)}")
    if "recompute" in report:
        lines.append(f"recompute={report['recompute']['mode']} (recomputed in backward, per chunk):")
        for i, segs in enumerate(report["recompute"]["chunks"]):
            what = ", ".join(f"{s['segment']} ({s['ops']} ops)" for s in segs) or "nothing (no region frees more of the saved bytes than it costs of the FLOPs)"
            why = f"  [{segs[0]['why']}]" if segs else ""
            lines.append(f"  chunk {i}: {what}{why}")
    ring = [e for r in report["chunks"] for e in r["collectives"] if e["kind"] == "ring_send"]
    if ring:   # cp > 1: ring attention's K/V (and backward dK/dV) blocks, per rank
        width = 4 if prog.plan.dtype == "fp32" else 2
        fwd = sum(e["count_per_microbatch"] * e["elements"] for e in ring if e["phase"] == "forward") * width
        bwd = sum(e["count_per_microbatch"] * e["elements"] for e in ring if e["phase"] == "backward") * width
        m = prog.plan.microbatches
        lines.append(f"cp ring (p2p per rank): forward {human_bytes(fwd)}/mb, backward {human_bytes(bwd)}/mb, "
                     f"{human_bytes((fwd + bwd) * m)}/step")
    if "mesh" in report:
        # lazy: start-up: a command loads cli.step_report only when it runs
        from threefold.cli.step_report import format_step
        lines += format_step(report)
    lines += [f"note: {n}" for n in prog.notes if not n.startswith("tp fallback:")]
    tp = report.get("tensor_parallel")
    if tp and tp["fallbacks"]:
        lines.append(f"tensor-parallel fallbacks ({len(tp['fallbacks'])}; ops run on gathered inputs, "
                     "strict=true makes them errors):")
        lines += [f"  {fb['op']:<20} {fb['module']:<40} {human_bytes(fb['bytes_per_step'])}/step  {fb['reason']}"
                  for fb in tp["fallbacks"]]
    return "\n".join(lines)


def _tp_collectives(entries: list[dict]) -> str:
    """'fwd 5, bwd 4' tensor-parallel collectives per microbatch ('-' without tp)."""
    fwd = sum(e["count_per_microbatch"] for e in entries if e["group"] == "tp" and e["phase"] == "forward")
    bwd = sum(e["count_per_microbatch"] for e in entries if e["group"] == "tp" and e["phase"] == "backward")
    return f"fwd {fwd}, bwd {bwd}" if fwd or bwd else "-"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    text = ",".join(map(str, ranks))
    return text if len(text) <= 16 else f"{ranks[0]},{ranks[1]},..,{ranks[-1]}"


MEMORY_COLUMNS = ("params", "gathered", "grads", "optimizer", "activations", "recompute", "buffers", "total", "peak")


def print_memory(prog, memory: list[dict]) -> None:
    """The memory model per rank (planner/memory.py); ranks with equal figures share a row."""
    rows: list[tuple[list[int], dict]] = []
    for r in memory:
        figures = {k: r[k] for k in MEMORY_COLUMNS}
        if rows and rows[-1][1] == figures and rows[-1][0][-1] == r["rank"] - 1:
            rows[-1][0].append(r["rank"])
        else:
            rows.append(([r["rank"]], figures))
    title = (f"memory per rank, plan {prog.plan}: AdamW state"
             + (f" sharded over dp_shard (zero={prog.plan.zero}"
                + ("; gradients too" if prog.plan.zero >= 2 else "")
                + ("; parameters too, gathered per layer" if prog.plan.zero >= 3 else "") + ")"
                if getattr(prog.plan, "zero", 0) else "")
             + "; activations = the schedule's peak of saved-for-backward bytes; total = the sum of each"
             + " component's peak, peak = the step's (what coexists; `check --dry-run` measures it)")
    cells = [[_ranks(ranks), str(memory[ranks[0]]["stage"] if ranks[0] < len(memory) else "")]
             + [human_bytes(f[k]) for k in MEMORY_COLUMNS] for ranks, f in rows]
    headers = ["ranks", "stage", *MEMORY_COLUMNS]
    if sys.stdout.isatty():
        from rich import box   # lazy: rich loads only for the progress display
        from rich.console import Console   # lazy: rich loads only for the progress display
        from rich.table import Table   # lazy: rich loads only for the progress display
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
        for h in headers:
            table.add_column(h, justify="right", no_wrap=True)
        for row in cells:
            table.add_row(*row)
        Console().print(table)
        return
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
