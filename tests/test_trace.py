"""Tracing without ranks: the statistics read from a trace equal the simulator's when the
trace is the simulation, the checks against the schedule catch a broken trace, the trace
is valid trace-event JSON, and a step that is not traced reads no clock."""
from __future__ import annotations

import json

import pytest

from threefold.errors import PlanError
from threefold.runtime import comm, trace
from threefold.runtime.trace_stats import schedule_order_problems, summarize
from tests.trace_helpers import synthetic_trace

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("gpipe", 1)]


def check_trace_event_format(t: dict) -> None:
    """The JSON object form of the trace-event format as Perfetto and chrome://tracing read it."""
    text = json.dumps(t, allow_nan=False)          # plain JSON, no NaN/inf
    assert json.loads(text) == t
    assert isinstance(t["traceEvents"], list) and t["displayTimeUnit"] in ("ms", "ns")
    named_process, named_thread = set(), set()
    for e in t["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["name"], str) and e["name"]
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            if e["name"] == "process_name":
                named_process.add(e["pid"])
            if e["name"] == "thread_name":
                named_thread.add((e["pid"], e["tid"]))
        else:
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert isinstance(e["cat"], str) and isinstance(e["args"], dict)
            assert (e["pid"], e["tid"]) in named_thread and e["pid"] in named_process


@pytest.mark.parametrize("kind,v", SCHEDULES)
def test_measured_equals_simulated_on_a_simulated_trace(kind, v):
    t, sim = synthetic_trace(kind, pp=2, m=4, v=v, steps=(3, 5))
    check_trace_event_format(t)
    s = summarize(t)
    assert [x["step"] for x in s["steps"]] == [3, 5]
    assert s["measured"]["window_s"] == pytest.approx(sim.makespan / 1e3)
    assert s["measured"]["bubble_fraction"] == pytest.approx(sim.bubble_fraction)
    assert s["simulated"]["bubble_fraction"] == pytest.approx(sim.bubble_fraction)
    assert s["simulated"]["makespan_s"] == pytest.approx(sim.makespan / 1e3)
    assert s["measured"]["busy_s"] == pytest.approx([b / 1e3 for b in sim.busy])
    assert 0 < s["measured"]["bubble_fraction"] < 1
    assert schedule_order_problems(t) == []


def test_schedule_checks_catch_broken_traces():
    def drop_first_compute(rank, events):
        first = next(i for i, e in enumerate(events) if e[2] == "compute")
        return events[:first] + events[first + 1:]

    def swap_computes(rank, events):   # F0.1 runs before F0.0 (times exchanged)
        idx = [i for i, e in enumerate(events) if e[2] == "compute"][:2]
        a, b = events[idx[0]], events[idx[1]]
        events[idx[0]], events[idx[1]] = (*a[:3], b[3], b[4], a[5]), (*b[:3], a[3], a[4], b[5])
        return events

    def land_late(rank, events):       # every receive lands a long time after its reader ran
        return [(*e[:3], e[3] + 10**9, e[4] + 10**9, e[5]) if e[5].get("phase") == "land" else e for e in events]

    for broken, words in ((drop_first_compute, "missing"), (swap_computes, "out of the schedule's order"),
                          (land_late, "landed after")):
        t, _ = synthetic_trace("1f1b", 2, 4, shuffle=broken)
        problems = schedule_order_problems(t)
        assert problems and any(words in p for p in problems), (broken.__name__, problems)


def test_clock_offsets_shift_ranks():
    from threefold.runtime.trace_merge import chrome_trace
    ranks = [{"rank": r, "events": [(1, "F0.0", "compute", 1000 + off, 3000 + off, {"step": 1})],
              "event_ns": 1.0, "step_ns": [1], "coord": {"tp": 0, "dp": 0, "pp": r}}
             for r, off in enumerate((0, 5_000_000))]
    t = chrome_trace(ranks, [0, 5_000_000], [0, 10], {"steps": [1]})
    xs = [e for e in t["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in xs] == [0.0, 0.0] and [e["dur"] for e in xs] == [2.0, 2.0]
    assert t["otherData"]["clock_sync"]["offset_ns"] == [0, 5_000_000]


def test_untraced_calls_read_no_clock(monkeypatch):
    """Off means off: comm's recorded functions and a NoTracer read no clock."""
    reads = []
    monkeypatch.setattr(trace, "clock", lambda: reads.append(1) or 0)

    class Work:
        def wait(self):
            return None
    assert comm._recorders == []
    comm.wait(Work(), "nothing")
    with trace.NoTracer().step(3):
        with trace.NoTracer().span("optimizer step"):
            pass
    assert reads == []
    rec = trace.Recorder(0, [])
    comm._recorders.append(rec)
    try:
        comm.wait(Work(), "something")
    finally:
        comm._recorders.remove(rec)
    assert reads and rec.events[0][1] == "wait: something"


def test_recorder_wraps_actions_in_order():
    from threefold.runtime.schedule import make_schedule
    s = make_schedule("1f1b", 2, 2)
    rec = trace.Recorder(1, s.actions[1])
    ran = []
    handlers = {k: (lambda st, a: ran.append(str(a))) for k in ("F", "B")}
    wrapped, post, land = rec.wrap(handlers, lambda st, a: "pending", lambda st, a, p: ran.append(p))
    acts = s.actions[1]
    assert post(None, acts[0]) == "pending"
    land(None, acts[0], "landed")
    wrapped["F"](None, acts[1])
    assert ran == ["landed", str(acts[1])]
    assert [(e[1], e[5]["phase"], e[5]["index"]) for e in rec.events] == [
        (f"post {acts[0]}", "post", 0), (str(acts[0]), "land", 0), (str(acts[1]), "run", 1)]


@pytest.mark.parametrize("text,steps", [("3", [3]), ("5,3, 7", [3, 5, 7])])
def test_parse_steps(text, steps):
    assert trace.parse_steps(text) == steps


@pytest.mark.parametrize("text", ["", "0", "x", "3,-1"])
def test_parse_steps_refuses(text):
    with pytest.raises(PlanError, match="--trace-steps"):
        trace.parse_steps(text)
