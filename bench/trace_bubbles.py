"""Measured vs simulated bubble from `--trace`, and what tracing costs, at pp=2.

One launched 2-rank job (one rank per core, one thread each) trains the example GPT (lm_head
untied, layer-aligned splits as bench/pipeline_bubbles.py) under 1f1b, interleaved (v=2),
zb-h1 and zbv (v=2) at m=4 and m=8. Per setup: 2 warm-up steps, then pairs of steps, the
first of each pair traced and the second not (runtime/trace.StepTracer: steps 3, 5, 7, ...),
a barrier before every step. Reported per setup:

  * bubble: measured from the trace (idle rank-time / (2 x window), window from the first
    schedule action to the last on either rank; runtime/trace_stats.py), the simulator's
    prediction for the same schedule fed the measured action times, and the simulator's
    unit-cost bubble (forward 1, backward 2; zero bubble F = B = W = 1);
  * tracing overhead: the paired median of (traced step / the untraced step after it),
    rank 0's wall time from the barrier to the end of the optimizer step, and the tracer's
    own estimate (records per step x measured ns per record).

    python bench/trace_bubbles.py [--ms 4,8] [--pairs 4] [--json] [--out DIR] [--shots DOCS_DIR]

--out writes each setup's trace.json and trace page; --shots writes docs PNGs taken by
headless Chromium (the zbv m=8 trace page and the inspect report with that trace).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from pipeline_bubbles import threefold_plan  # noqa: E402
from pipeline_vs_torch import Config, build_workload  # noqa: E402

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]
WARMUP = 2


def _setup(kind: str, v: int, m: int, pairs: int) -> dict:
    """One setup on this rank: the trace (rank 0) and every step's wall time."""
    import threefold
    from threefold.runtime.trace import StepTracer
    cfg = Config(microbatches=m)
    w = build_workload(cfg)
    pm = threefold.parallelize(w["model"], threefold_plan(cfg, kind, v, m), w["inputs"], w["loss_fn"],
                               target=w["target"])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    traced = [WARMUP + 1 + 2 * k for k in range(pairs)]
    tracer = StepTracer(pm.engine, traced, {"workload": "bench/trace_bubbles.py GPT"})
    seconds = []
    for step in range(1, WARMUP + 2 * pairs + 1):
        dist.barrier()
        t0 = time.perf_counter()
        with tracer.step(step):
            opt.zero_grad()
            pm.step(*w["inputs"], target=w["target"])
            with tracer.span("optimizer step"):
                opt.step()
        seconds.append(time.perf_counter() - t0)
    trace = tracer.finish()
    return {"trace": trace, "seconds": seconds, "traced": traced}


def _job(ms: list[int], pairs: int) -> list[dict]:
    torch.set_num_threads(1)
    return [dict(kind=kind, v=v, m=m, **_setup(kind, v, m, pairs)) for m in ms for kind, v in SCHEDULES]


def _row(setup: dict) -> dict:
    from threefold.runtime.schedule import Schedule
    from threefold.runtime.simulate import simulate
    from threefold.runtime.trace_stats import summarize
    t = setup["trace"]
    s = summarize(t)
    unit = simulate(Schedule.from_json(t["otherData"]["schedule"])).bubble_fraction
    sec = setup["seconds"]
    ratios = [sec[k - 1] / sec[k] for k in setup["traced"]]     # traced step / the untraced one after it
    tracer = s["tracer"]["per_rank"]
    return {"schedule": setup["kind"], "m": setup["m"], "v": setup["v"],
            "measured_bubble": s["measured"]["bubble_fraction"],
            "simulated_bubble_measured_times": s["simulated"]["bubble_fraction"], "simulated_bubble_unit": unit,
            "window_ms": s["measured"]["window_s"] * 1e3, "simulated_makespan_ms": s["simulated"]["makespan_s"] * 1e3,
            "idle_ms": [x * 1e3 for x in s["measured"]["idle_s"]],
            "overhead_paired_median": statistics.median(ratios), "overhead_pairs": ratios,
            "overhead_estimate_ms": max(r["estimated_ns_per_step"] for r in tracer) / 1e6,
            "records_per_step": max(r["records_per_step"] for r in tracer),
            "ns_per_record": max(r["ns_per_record"] for r in tracer),
            "step_ms_untraced": statistics.median(sec[k] for k in setup["traced"]) * 1e3}


def _write(out: str, setups: list[dict]) -> dict[str, str]:
    from threefold.cli.jsonout import dumps
    from threefold.report.trace_page import trace_html
    os.makedirs(out, exist_ok=True)
    paths = {}
    for s in setups:
        base = os.path.join(out, f"trace_{s['kind']}_m{s['m']}")
        with open(base + ".json", "w") as f:
            f.write(dumps(s["trace"]))
        with open(base + ".html", "w", encoding="utf-8") as f:
            f.write(trace_html(s["trace"]))
        paths[(s["kind"], s["m"])] = base
    return paths


def _shots(docs: str, setup: dict, tmp: str) -> None:
    """docs/trace.png (the trace page) and docs/report.png (inspect --html with the trace)."""
    from playwright.sync_api import sync_playwright
    import shutil
    import threefold
    from threefold.cli.inspect_cmd import chunk_report, write_html
    from threefold.compiler.api import compile_workload
    from threefold.report.trace_page import trace_html
    cfg = Config(microbatches=setup["m"])
    prog = compile_workload(threefold.Workload(**{k: v for k, v in build_workload(cfg).items()
                                                  if k in ("model", "inputs", "target", "loss_fn")}),
                            threefold_plan(cfg, setup["kind"], setup["v"], setup["m"]))
    report_path, trace_path = os.path.join(tmp, "report.html"), os.path.join(tmp, "trace.html")
    write_html(prog, chunk_report(prog), report_path, setup["trace"])
    with open(trace_path, "w", encoding="utf-8") as f:
        f.write(trace_html(setup["trace"]))
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=flags)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto("file://" + trace_path)
        page.screenshot(path=os.path.join(docs, "trace.png"), full_page=True)
        page.goto("file://" + report_path)
        page.fill("#search", "attn.c_attn")
        page.screenshot(path=os.path.join(docs, "report.png"), full_page=False)
        page.fill("#search", "")
        page.evaluate("document.getElementById('memory').scrollIntoView()")
        page.screenshot(path=os.path.join(docs, "report_memory_schedule.png"), full_page=False)
        browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="4,8", help="microbatch counts (default 4,8)")
    ap.add_argument("--pairs", type=int, default=4, help="traced/untraced step pairs per setup (default 4)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="write every setup's trace.json and trace page here")
    ap.add_argument("--shots", metavar="DOCS", help="write trace.png and report.png (headless Chromium) here")
    args = ap.parse_args()
    import threefold
    ms = [int(x) for x in args.ms.split(",")]
    t0 = time.perf_counter()
    setups = threefold.launch(_job, 2, ms, args.pairs, timeout=3000)[0]
    rows = [_row(s) for s in setups]
    if args.out:
        _write(args.out, setups)
    if args.shots:
        import tempfile
        pick = next(s for s in setups if s["kind"] == "zbv" and s["m"] == max(ms))
        _shots(args.shots, pick, tempfile.mkdtemp(prefix="threefold-shots-"))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"pp=2 on 2 gloo ranks, GPT n_layer=8 n_embd=256 seq=128 batch=16; {args.pairs} traced/untraced pairs; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'schedule':<12}{'m':>3} {'measured':>9} {'sim(meas)':>10} {'sim(unit)':>10} {'window ms':>10} "
          f"{'sim ms':>8} {'overhead':>9} {'est ms':>7} {'step ms':>8}")
    for r in rows:
        print(f"{r['schedule']:<12}{r['m']:>3} {r['measured_bubble']:>9.1%} {r['simulated_bubble_measured_times']:>10.1%} "
              f"{r['simulated_bubble_unit']:>10.1%} {r['window_ms']:>10.1f} {r['simulated_makespan_ms']:>8.1f} "
              f"{r['overhead_paired_median']:>8.3f}x {r['overhead_estimate_ms']:>7.2f} {r['step_ms_untraced']:>8.1f}")
    worst = max(rows, key=lambda r: r["overhead_paired_median"])
    gap = max(rows, key=lambda r: r["measured_bubble"] - r["simulated_bubble_measured_times"])
    print(f"worst tracing overhead: {worst['overhead_paired_median']:.3f}x ({worst['schedule']} m={worst['m']}); "
          f"largest measured - simulated bubble: {gap['measured_bubble'] - gap['simulated_bubble_measured_times']:+.1%} "
          f"({gap['schedule']} m={gap['m']})")


if __name__ == "__main__":
    main()
