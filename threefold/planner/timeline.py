"""A plan's pipeline timeline: the runtime's schedule, timed with the performance model.

The order is the one the runtime will execute (`runtime.schedule.make_schedule` for the
plan's schedule, pp, m and v), timed by the runtime's simulator with the per-stage times
the performance model predicts (one chunk's forward and backward) and the boundary
transfer on every send, and drawn by the runtime's SVG renderer. Nothing about the order
is rebuilt here, so the picture and its bubble are the simulator's for any m, including
m that is not a multiple of pp.
"""
from __future__ import annotations

from threefold.planner.estimate import Estimate
from threefold.runtime.schedule import Action, Kind, make_schedule
from threefold.runtime.simulate import Simulation, simulate
from threefold.runtime.timeline_svg import render_svg

MS = 1e3   # the picture's time unit: milliseconds


def shown_microbatches(pp: int, m: int, v: int, max_steps: int = 4000) -> int:
    """Microbatches drawn: all of them, or a multiple of pp (at least 2 groups) when the
    picture would have more than `max_steps` boxes."""
    if 2 * pp * v * m <= max_steps:
        return m
    return min(m, max(2 * pp, (max_steps // (2 * pp * v)) // pp * pp))


def plan_simulation(est: Estimate, max_steps: int = 4000) -> Simulation:
    """The runtime's simulation of the estimate's plan, times in milliseconds."""
    plan = est.config.plan
    m = shown_microbatches(plan.pp, plan.microbatches, plan.interleave, max_steps)
    schedule = make_schedule(plan.schedule, plan.pp, m, plan.interleave)
    times = est.stage_times

    # zero bubble: a chunk's backward is B (input grads) then W (its weight-gradient GEMMs)
    weights = est.weight_times if schedule.splits_backward else [0.0] * len(times)

    def ms(a: Action) -> float:
        stage = schedule.stage_of(a.chunk)
        if a.kind is Kind.FORWARD:
            return times[stage][0] * MS
        if a.kind is Kind.BACKWARD:
            return (times[stage][1] - weights[stage]) * MS
        if a.kind is Kind.WEIGHT:
            return weights[stage] * MS
        return est.transfer_s * MS if a.is_send else 0.0
    return simulate(schedule, ms)


def timeline_svg(est: Estimate, max_steps: int = 4000) -> str:
    """SVG of the estimate's pipeline (microbatches capped so the drawing stays small)."""
    c = est.config
    sim = plan_simulation(est, max_steps)
    title = (f"{c.plan}  b={c.microbatch_size}  predicted {est.tflops_per_gpu:.0f} TFLOP/s/GPU, "
             f"bubble {sim.bubble_fraction:.1%} of rank-time, time in ms")
    if sim.schedule.m < c.microbatches:
        title += f"  (first {sim.schedule.m} of {c.microbatches} microbatches shown)"
    return render_svg(sim, width=1200, title=title)
