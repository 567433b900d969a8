"""Pipeline time of a zero-bubble plan (zb-h1, zbv).

`bubble_seconds` is what the search ranks by, the paper's closed forms (Qi et al. 2401.10241)
in the per-stage times of one microbatch's F, B (input gradients) and W (weight gradients):

    ZB-H1   (p-1) * max(F + B - W, 0)
    ZB-V    (p-1) * max(F/2, F + B - 2W)        (F/2: one chunk's forward, the V's ramp)

With T_F = T_B = T_W they are exactly what the runtime's orders give when simulated
(runtime/zero_bubble.py; tests check it): p-1 units of one chunk's step. With other costs
the static orders, written for equal costs, can leave more idle time than the forms say;
`pipeline_seconds` simulates the runtime's own order with any per-chunk times (the
timeline picture and the tests use it; it is too slow to run for every candidate of a big
search).
"""
from __future__ import annotations

from threefold.runtime.schedule import Action, Kind, make_schedule
from threefold.runtime.simulate import simulate


def bubble_seconds(schedule: str, pp: int, f: float, b: float, w: float) -> float:
    """Idle time of one iteration's pipeline (module docstring); f, b, w: one microbatch's
    F, B and W on a stage (all its chunks)."""
    if schedule == "zbv":
        return (pp - 1) * max(f / 2, f + b - 2 * w)
    return (pp - 1) * max(f + b - w, 0.0)


def pipeline_seconds(schedule: str, pp: int, m: int, v: int, times: list[tuple[float, float, float]],
                     transfer_s: float = 0.0, cap: int | None = None) -> float:
    """Makespan of one iteration's pipeline. times[stage] = (F, B, W) seconds of one chunk of
    that stage; every send takes transfer_s (receives wait for it)."""
    cap = cap or max(2 * pp + 2, 4)
    if m <= cap:
        return _makespan(schedule, pp, m, v, times, transfer_s)
    base = _makespan(schedule, pp, cap, v, times, transfer_s)
    step = base - _makespan(schedule, pp, cap - 1, v, times, transfer_s)
    return base + (m - cap) * step


def _makespan(schedule: str, pp: int, m: int, v: int, times, transfer_s: float) -> float:
    sched = make_schedule(schedule, pp, m, v)
    column = {Kind.FORWARD: 0, Kind.BACKWARD: 1, Kind.WEIGHT: 2}

    def seconds(a: Action) -> float:
        k = column.get(a.kind)
        if k is not None:
            return times[sched.stage_of(a.chunk)][k]
        return transfer_s if a.is_send else 0.0
    return simulate(sched, seconds).makespan
