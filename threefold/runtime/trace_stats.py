"""What a trace says about the pipeline: the measured bubble and idle time per rank, next to
the simulator's prediction for the same schedule fed the measured action times.

Definitions follow runtime/simulate.py, so the two columns compare like with like:
  window            from the first schedule action's start on any rank to the last one's
                    end on any rank (the simulator's makespan: every rank starts at 0)
  busy (rank)       the time spent in its F, B and W actions
  idle (rank)       window - busy: waits, transfers and everything that is not compute
  bubble_fraction   sum of idle / (ranks * window)
Simulated: `simulate(schedule, durations)` where an action's duration is its measured
time (its stage's ranks and the traced steps averaged): computes and send posts as
measured, receives 0 (their waiting is what the simulator predicts), so the gap between
the two is what the real transfers, waits and scheduling cost beyond the schedule itself.
"""
from __future__ import annotations

from collections import defaultdict

from threefold.runtime.schedule import Kind, Schedule, parse_action
from threefold.runtime.simulate import simulate

COMPUTE_KINDS = ("F", "B", "W")


def action_events(trace: dict) -> list[dict]:
    """The events of schedule actions: one per action run (computes, sends) or landed
    (receives) per rank and step; their posts are left out."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "action" in e.get("args", {})
            and e["args"].get("phase") != "post"]


def step_stats(trace: dict, step: int) -> dict:
    """Measured window, busy and idle per rank (seconds) and the bubble of one traced step."""
    events = [e for e in action_events(trace) if e["args"]["step"] == step]
    if not events:
        return {}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    window = (end - start) / 1e6
    ranks = sorted({e["pid"] for e in trace["traceEvents"] if e.get("ph") == "M"})
    busy = {r: 0.0 for r in ranks}
    for e in events:
        if e["args"]["kind"] in COMPUTE_KINDS:
            busy[e["pid"]] += e["dur"] / 1e6
    idle = [window - busy[r] for r in ranks]
    return {"step": step, "window_s": window, "busy_s": [busy[r] for r in ranks], "idle_s": idle,
            "bubble_fraction": sum(idle) / (len(ranks) * window) if window else 0.0}


def measured_durations(trace: dict, schedule: Schedule, mesh: dict) -> dict:
    """(stage, action text) -> mean measured seconds over the stage's ranks and the steps."""
    per_stage_rank = mesh["tp"] * mesh["dp"]
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in action_events(trace):
        stage = e["pid"] // per_stage_rank          # Megatron's layout: pp outermost
        sums[(stage, e["args"]["action"])].append(e["dur"] / 1e6)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def simulation(trace: dict, unit: float = 1.0):
    """The simulator's run of the traced schedule with the measured action times (in seconds
    times `unit`: 1e3 draws milliseconds)."""
    other = trace["otherData"]
    schedule = Schedule.from_json(other["schedule"])
    times = measured_durations(trace, schedule, other["mesh"])

    # a stage-level action (wg, ls, dn, ts: no chunk) reads the same on every stage: its mean
    by_text: dict[str, list[float]] = defaultdict(list)
    for (_, text), t in times.items():
        by_text[text].append(t)

    def dur(a) -> float:
        if a.is_recv:
            return 0.0
        if 0 <= a.chunk < schedule.num_chunks:
            return times.get((schedule.stage_of(a.chunk), str(a)), 0.0) * unit
        seen = by_text.get(str(a), [0.0])
        return sum(seen) / len(seen) * unit
    return simulate(schedule, dur)


def simulated(trace: dict) -> dict:
    """The simulator's prediction for the traced schedule with the measured action times."""
    sim = simulation(trace)
    return {"makespan_s": sim.makespan, "busy_s": list(sim.busy),
            "idle_s": [sim.makespan - b for b in sim.busy], "bubble_fraction": sim.bubble_fraction}


def summarize(trace: dict) -> dict:
    """Measured (per traced step and their mean) and simulated bubble, idle per rank, and the
    tracer's own cost: what `threefold train --trace` prints and the report shows."""
    other = trace["otherData"]
    steps = [s for s in (step_stats(trace, k) for k in other.get("steps", [])) if s]
    if not steps:
        return {"steps": [], "measured": None, "simulated": None, "tracer": other.get("tracer")}
    n = len(steps)
    ranks = len(steps[0]["idle_s"])
    measured = {"window_s": sum(s["window_s"] for s in steps) / n,
                "bubble_fraction": sum(s["bubble_fraction"] for s in steps) / n,
                "idle_s": [sum(s["idle_s"][r] for s in steps) / n for r in range(ranks)],
                "busy_s": [sum(s["busy_s"][r] for s in steps) / n for r in range(ranks)]}
    return {"steps": steps, "measured": measured, "simulated": simulated(trace),
            "tracer": other.get("tracer")}


def schedule_order_problems(trace: dict) -> list[str]:
    """Checks a trace against its schedule, per rank and step: every action of the rank's
    list appears exactly once; every action but the receives ran in the list's order; every receive
    was posted before it landed, landed before the compute that reads it, and receives from
    one peer were posted in list order. Returns what is wrong (empty: nothing)."""
    other = trace["otherData"]
    schedule = Schedule.from_json(other["schedule"])
    mesh = other["mesh"]
    per_stage = mesh["tp"] * mesh["dp"]
    problems = []
    by_key: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and "action" in e.get("args", {}):
            by_key[(e["pid"], e["args"]["step"])].append(e)
    ranks = sorted({e["pid"] for e in trace["traceEvents"] if e.get("ph") == "M"})
    for step in other.get("steps", []):
        for rank in ranks:
            expected = [str(a) for a in schedule.actions[rank // per_stage]]
            # equal start times (zero-length events) are ordered by their place in the list
            events = sorted(by_key.get((rank, step), []), key=lambda e: (e["ts"], e["args"]["index"]))
            runs = [e for e in events if e["args"]["phase"] != "post"]
            posts = {e["args"]["action"]: e for e in events if e["args"]["phase"] == "post"}
            seen = [e["args"]["action"] for e in runs]
            where = f"rank {rank} step {step}"
            if sorted(seen) != sorted(expected):
                missing = sorted(set(expected) - set(seen))[:3]
                extra = sorted(set(seen) - set(expected))[:3]
                twice = sorted({a for a in seen if seen.count(a) > 1})[:3]
                problems.append(f"{where}: actions differ from the schedule (missing {missing}, "
                                f"not in it {extra}, twice {twice})")
                continue
            ordered = [a for a in seen if not parse_action(a).is_recv]
            if ordered != [a for a in expected if not parse_action(a).is_recv]:
                problems.append(f"{where}: computes, sends and collectives ran out of the schedule's order")
            start = {e["args"]["action"]: e for e in runs}
            for text in expected:
                a = parse_action(text)
                if not a.is_recv:
                    continue
                post, land = posts.get(text), start[text]
                if post is None or post["ts"] > land["ts"]:
                    problems.append(f"{where}: {text} landed without being posted first")
                reader = Kind.FORWARD if a.kind is Kind.RECV_ACT else Kind.BACKWARD
                use = start.get(f"{reader.value}{a.chunk}.{a.mb}")
                if use is not None and land["ts"] + land["dur"] > use["ts"] + 1e-3:
                    problems.append(f"{where}: {text} landed after {use['name']} started")
            peers: dict[int, list[str]] = defaultdict(list)
            for e in sorted(posts.values(), key=lambda e: (e["ts"], e["args"]["index"])):
                peers[parse_action(e["args"]["action"]).peer].append(e["args"]["action"])
            for peer, got in peers.items():
                want = [t for t in expected if parse_action(t).is_recv and parse_action(t).peer == peer]
                if got != want:
                    problems.append(f"{where}: receives from stage {peer} were posted out of list order")
    return problems
