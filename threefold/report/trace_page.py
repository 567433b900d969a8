"""The measured timeline of a trace (runtime/trace_merge.py's Chrome trace): the bubble and
idle time per rank next to the simulator's prediction (runtime/trace_stats.py), the timeline
itself (drawn in the browser by static/report.js from the embedded trace), and the same
schedule simulated with the measured action times (runtime/timeline_svg.py)."""
from __future__ import annotations

import os
import sys
from html import escape

from threefold.cli.jsonout import dumps
from threefold.outdir import write_file_atomically
from threefold.report.page import page, table
from threefold.runtime.trace_stats import simulation, summarize
from threefold.runtime.timeline_svg import render_svg

LEGEND = (("F", "#4c78a8", "forward"), ("B", "#59a14f", "backward (zb: B)"), ("W", "#f28e2b", "W"),
          ("opt", "#8e6bb8", "clip / optimizer"), ("send", "#7f9cc0", "send post"),
          ("recv", "#b5c7dc", "receive post"), ("wait", "#e0787a", "wait (receive, send, collective)"),
          ("coll", "#e6b422", "collective"), ("step", "#d9dde3", "whole step"))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def trace_sections(trace: dict) -> list[tuple[str, str, str]]:
    stats = summarize(trace)
    other = trace["otherData"]
    out = []
    if stats["measured"] is not None:
        m, s = stats["measured"], stats["simulated"]
        per_stage = other["mesh"]["tp"] * other["mesh"]["dp"]
        rows = [["pipeline window (first action to last)", _ms(m["window_s"]), _ms(s["makespan_s"])],
                ["bubble (idle share of rank-time)", f"{m['bubble_fraction']:.1%}", f"{s['bubble_fraction']:.1%}"]]
        for r, idle in enumerate(m["idle_s"]):
            rows.append([f"idle, rank {r}", _ms(idle), _ms(s["idle_s"][r // per_stage])])
        tracer = stats["tracer"]
        note = (f"Measured over step(s) {', '.join(map(str, other['steps']))}; simulated: this schedule run "
                "by runtime/simulate.py with each action's measured time (receives 0), so the difference is "
                "what transfers, waits and the runtime cost beyond the schedule. Tracing cost about "
                f"{max(p['estimated_ns_per_step'] for p in tracer['per_rank']) / 1e6:.2f} ms per step "
                f"({tracer['worst_share_of_step']:.2%} of it on the worst rank). Clocks aligned to rank 0 "
                f"by round trips: offsets {', '.join(f'{o / 1e3:.0f}' for o in other['clock_sync']['offset_ns'])} us, "
                f"within half of {', '.join(f'{t / 1e3:.0f}' for t in other['clock_sync']['round_trip_ns'])} us.")
        out.append(("bubble", "Measured vs simulated bubble",
                    f'<p class="note">{escape(note)}</p><div class="stats">'
                    + table(["", "measured", "simulated"], rows) + "</div>"))
    legend = "".join(f'<span><i style="background:{c}"></i>{escape(t)}</span>' for _, c, t in LEGEND)
    out.append(("timeline", "Measured timeline",
                '<div class="timeline-controls"><label>step <select id="trace-step"></select></label>'
                '<label>zoom <input id="trace-zoom" type="range" min="1" max="30" step="1" value="1"></label>'
                f'<span class="legend">{legend}</span></div>'
                '<div id="trace-timeline" class="svgbox"></div>'
                '<p class="note">One process per rank, one lane per stream (step, compute, send, recv, '
                'collectives), as the trace file shows them in Perfetto or chrome://tracing.</p>'))
    if stats["measured"] is not None:
        sim = simulation(trace, unit=1e3)
        svg = render_svg(sim, title=f"simulated with the measured action times (ms): {other['plan']}")
        out.append(("simulated", "Simulated with the measured times", f'<div class="svgbox">{svg}</div>'))
    return out


def trace_html(trace: dict) -> str:
    """A page of the trace alone (what `threefold train --trace` writes next to trace.json)."""
    other = trace["otherData"]
    facts = escape(f"plan {other['plan']} · schedule {other['schedule']['schedule']} · traced step(s) "
                   f"{', '.join(map(str, other['steps']))} · {other.get('workload', '')}")
    return page(f"threefold trace: {other['plan']}", facts, trace_sections(trace), {"trace": trace}, search=False)


def write_trace(out: str, trace: dict) -> None:
    """OUT/trace.json and OUT/trace.html from a merged trace (THREEFOLD_TRACE for parallelize)."""
    os.makedirs(out, exist_ok=True)
    write_file_atomically(os.path.join(out, "trace.json"), dumps(trace))
    write_file_atomically(os.path.join(out, "trace.html"), trace_html(trace))
    print(f"threefold: trace of step {', '.join(map(str, trace['otherData']['steps']))} written to "
          f"{os.path.join(out, 'trace.json')}", file=sys.stderr)
