"""Traces made without running anything: a schedule's simulated times written as the
ranks' records, merged by the real runtime/trace_merge.chrome_trace (for tests of the
statistics, the checks against the schedule and the HTML pages)."""
from __future__ import annotations

from threefold.runtime.schedule import Kind, make_schedule
from threefold.runtime.simulate import simulate
from threefold.runtime.trace import COMPUTE, RECV, SEND, STEP
from threefold.runtime.trace_merge import chrome_trace

MS = 1_000_000   # ns


def synthetic_trace(kind: str = "1f1b", pp: int = 2, m: int = 4, v: int = 1, steps=(3,), plan: str | None = None,
                    shuffle=None) -> dict:
    """Every rank's actions at their simulated times (unit = 1 ms, receives posted at the
    step's start and landed at their simulated end), for each step; `shuffle(rank, events)`
    may edit a rank's events (to make broken traces)."""
    schedule = make_schedule(kind, pp, m, v)
    sim = simulate(schedule)
    ranks = []
    for r, acts in enumerate(schedule.actions):
        events = []
        for k, step in enumerate(steps):
            base = k * (sim.makespan + 2) * MS
            events.append((STEP, f"step {step}", "step", base, base + int(sim.makespan * MS), {"step": step}))
            for i, (a, t0, t1) in enumerate(zip(acts, sim.start[r], sim.end[r])):
                args = {"action": str(a), "kind": a.kind.value, "chunk": a.chunk, "mb": a.mb, "index": i,
                        "step": step}
                t0, t1 = base + int(t0 * MS), base + int(t1 * MS)
                if a.is_recv:
                    events.append((RECV, f"post {a}", "recv", base, base, {**args, "phase": "post"}))
                    events.append((RECV, str(a), "wait", t0, t1, {**args, "phase": "land"}))
                else:
                    stream = SEND if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) else COMPUTE
                    events.append((stream, str(a), "compute" if stream == COMPUTE else "send", t0, t1,
                                   {**args, "phase": "run"}))
        if shuffle is not None:
            events = shuffle(r, events)
        ranks.append({"rank": r, "events": events, "event_ns": 300.0, "step_ns": [int(sim.makespan * MS)] * len(steps),
                      "coord": {"tp": 0, "dp": 0, "pp": r}})
    meta = {"plan": plan or f"tp=1,pp={pp},dp=1,m={m},v={v},schedule={kind}", "steps": list(steps),
            "schedule": schedule.to_json(), "mesh": {"tp": 1, "dp": 1, "pp": pp}, "workload": "synthetic"}
    return chrome_trace(ranks, [0] * pp, [0] * pp, meta), sim
