"""Zero-bubble schedules (zb-h1, zbv): verifier, exact bubble formulas, memory bounds, V layout, CLI."""
from __future__ import annotations

import dataclasses
import json

import pytest

from threefold.cli.main import main
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.runtime.mesh import stage_of
from threefold.runtime.schedule import (Action, Kind, ScheduleError, forward_only, inflight_bound,
                                        make_schedule)
from threefold.runtime.simulate import simulate, verify
from threefold.runtime.zero_bubble import weight_inflight_bound


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_h1_verifies_and_bubble_is_a_third_of_1f1b(p):
    """ZB-H1, unit costs F = B = W = 1: makespan 3m + p - 1, bubble ratio (p-1)/(3m) for m >= p;
    1F1B on the same stages (F 1, fused backward 2): (p-1)/m."""
    for m in range(1, 33):
        report = verify(make_schedule("zb-h1", p, m))
        assert report.max_inflight == inflight_bound("zb-h1", p, m) == [min(p - r, m) for r in range(p)]
        assert report.simulation.max_weight_inflight == weight_inflight_bound("zb-h1", p, m) == [min(p, m)] * p
        if m >= p:
            assert report.makespan == 3 * m + p - 1
            assert report.bubble_ratio == pytest.approx((p - 1) / (3 * m), abs=1e-15)
            assert report.bubble_ratio == pytest.approx(report.formula_bubble_ratio, abs=1e-15)
            one_f_one_b = verify(make_schedule("1f1b", p, m))
            assert report.bubble_ratio == pytest.approx(one_f_one_b.bubble_ratio / 3, abs=1e-15)
            # every stage idles exactly p - 1 units (1F1B: 3(p - 1))
            assert [report.makespan - b for b in report.simulation.busy] == [p - 1] * p


@pytest.mark.parametrize("p", range(2, 9))
def test_zbv_verifies_and_has_no_steady_state_bubble(p):
    """ZB-V, unit costs per chunk: makespan 6m + p - 1 for m >= 2p - 1; stage s starts at s and
    then never idles (the ramp is the only bubble): bubble ratio (p-1)/(6m)."""
    for m in range(1, 33):
        report = verify(make_schedule("zbv", p, m, 2))
        bound = [min(2 * m, 2 * p, m + 1 + s) for s in range(p)]
        assert report.max_inflight == inflight_bound("zbv", p, m, 2) == bound
        assert report.simulation.max_weight_inflight == weight_inflight_bound("zbv", p, m) == bound
        if m >= 2 * p - 1:
            assert report.makespan == 6 * m + p - 1
            assert report.bubble_ratio == pytest.approx((p - 1) / (6 * m), abs=1e-15)
            assert report.bubble_ratio == pytest.approx(report.formula_bubble_ratio, abs=1e-15)
            sim = report.simulation
            for s, acts in enumerate(report.schedule.actions):
                spans = sorted((t0, t1) for a, t0, t1 in zip(acts, sim.start[s], sim.end[s]) if a.is_compute)
                assert spans[0][0] == s and spans[-1][1] == 6 * m + s
                assert all(b[0] == a[1] for a, b in zip(spans, spans[1:])), (p, m, s)   # no idle step


def test_zbv_uses_the_v_layout_and_hands_over_locally():
    s = make_schedule("zbv", 4, 8, 2)
    assert [stage_of(c, 4, "v") for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert s.layout == "v" and s.chunks_of(0) == [0, 7] and s.chunks_of(3) == [3, 4]
    # chunk 3 -> 4 is the V's turn on stage 3: no message, in either direction
    messages = [a for acts in s.actions for a in acts if not a.is_compute]
    assert not [a for a in messages if a.message[1] in (3, 4) and a.message[0] == "act" and a.chunk in (3, 4)
                and a.peer == 3]
    assert all(a.peer != r for r, acts in enumerate(s.actions) for a in acts if not a.is_compute)
    # the loss chunk (7) lives on stage 0, next to the first chunk
    assert Action(Kind.FORWARD, 7, 0) in s.actions[0]


def test_verifier_checks_w_actions():
    s = make_schedule("zb-h1", 2, 2)
    w = Action(Kind.WEIGHT, 1, 0)
    acts = [w] + [a for a in s.actions[1] if a != w]
    with pytest.raises(ScheduleError, match="W1.0.*runs before B1.0"):
        verify(dataclasses.replace(s, actions=[s.actions[0], acts]))
    missing = [a for a in s.actions[1] if a != Action(Kind.WEIGHT, 1, 1)]
    with pytest.raises(ScheduleError, match="W1.1 is missing"):
        verify(dataclasses.replace(s, actions=[s.actions[0], missing]))
    fused = make_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="no separate W"):
        verify(dataclasses.replace(fused, actions=[fused.actions[0], fused.actions[1] + [Action(Kind.WEIGHT, 1, 0)]]))


def test_verifier_checks_what_w_keeps():
    """Moving every W of the last stage to the end keeps all m microbatches for W: over the bound."""
    s = make_schedule("zb-h1", 4, 8)
    last = [a for a in s.actions[3] if a.kind is not Kind.WEIGHT] + [a for a in s.actions[3] if a.kind is Kind.WEIGHT]
    with pytest.raises(ScheduleError, match="keeps 8 microbatches for their weight gradients"):
        verify(dataclasses.replace(s, actions=s.actions[:3] + [last]))


def test_zero_bubble_json_round_trip_and_cost_durations():
    s = make_schedule("zbv", 2, 4, 2)
    again = type(s).from_json(json.loads(json.dumps(s.to_json())))
    assert again == s and again.layout == "v"
    # (fwd, b, w) per chunk; a (fwd, bwd) pair splits the backward in half
    three = simulate(s, {c: (1.0, 1.0, 1.0) for c in range(4)})
    two = simulate(s, {c: (1.0, 2.0) for c in range(4)})
    assert three.makespan == two.makespan == simulate(s).makespan == 25


def test_forward_only_on_the_v_layout():
    s = forward_only(3, 4, 2, layout="v")
    report = verify(s)
    assert s.layout == "v" and report.max_inflight == [0, 0, 0]
    assert [a for a in s.actions[2] if a.is_compute][:2] == [Action(Kind.FORWARD, 2, 0), Action(Kind.FORWARD, 2, 1)]


@pytest.mark.parametrize("text,words", [
    ("pp=2,m=4,v=3,schedule=zbv", "exactly two chunks per stage"),
    ("pp=1,m=4,schedule=zbv", "needs pp>1"),
    ("pp=2,m=4,v=2,schedule=zb-h1", "needs schedule=interleaved"),
])
def test_plan_checks_zero_bubble(text, words):
    with pytest.raises(PlanError, match=words):
        Plan.parse(text)


def test_plan_zbv_implies_two_chunks_per_stage():
    plan = Plan.parse("pp=4,m=8,schedule=zbv")
    assert plan.interleave == 2 and plan.num_chunks == 8 and Plan.parse(str(plan)) == plan
    with pytest.raises(PlanError, match="v=2"):
        make_schedule("zbv", 4, 8, 1)


def test_cli_shows_zero_bubble_schedules(capsys, tmp_path):
    assert main(["schedule", "--pp", "4", "-m", "8", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "W0.0" in out and "(p-1)/(3m) = 0.1250" in out and "makespan            27 steps" in out
    svg = tmp_path / "zbv.svg"
    assert main(["schedule", "--pp", "4", "-m", "8", "--schedule", "zbv", "--json", "--svg", str(svg)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["interleave"] == 2 and data["makespan"] == 51
    assert data["bubble_ratio"] == pytest.approx(3 / 48) and data["max_weight_inflight"] == [8, 8, 8, 8]
    text = svg.read_text()
    assert "W: weight grads" in text and "W7.0 on rank 0" in text
