"""Schedule IR, generators, verifier/simulator and `threefold schedule`."""
from __future__ import annotations

import dataclasses
import json

import pytest

from threefold.cli.main import main
from threefold.errors import PlanError
from threefold.runtime.schedule import (Action, Kind, Schedule, ScheduleError, forward_only, inflight_bound,
                                        make_schedule, microbatch_groups, parse_action)
from threefold.runtime.simulate import simulate, verify


def _cases(p):
    """Every (kind, v) the generators accept for p stages."""
    yield "gpipe", 1
    yield "1f1b", 1
    for v in range(1, 5 if p > 1 else 2):
        yield "interleaved", v
        yield "forward", v


# ---- the exhaustive check: all p <= 8, v <= 4, m <= 32 ------------------------------
@pytest.mark.parametrize("p", range(1, 9))
def test_verifier_accepts_every_generated_schedule(p):
    for m in range(1, 33):
        for kind, v in _cases(p):
            schedule = make_schedule(kind, p, m, v)
            report = verify(schedule)          # raises ScheduleError on any violation
            assert report.max_inflight == inflight_bound(kind, p, m, v), (kind, p, m, v)
            busy = 3 if kind != "forward" else 1        # forward 1 + backward 2 per (chunk, mb)
            if m >= p or v == 1:
                # The paper's bubble: (p-1)/(v*m) of the ideal compute time, exactly.
                assert report.makespan == busy * (v * m + p - 1), (kind, p, m, v)
                assert report.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=1e-12, abs=1e-15)
                assert report.bubble_ratio == pytest.approx(report.formula_bubble_ratio, rel=1e-12, abs=1e-15)
                assert report.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12, abs=1e-15)
            else:
                # Fewer microbatches than stages: chunks wait for the trip round the pipeline.
                assert report.bubble_ratio >= report.formula_bubble_ratio - 1e-12


def test_inflight_bounds_by_kind():
    assert verify(make_schedule("gpipe", 4, 8)).max_inflight == [8, 8, 8, 8]
    assert verify(make_schedule("1f1b", 4, 8)).max_inflight == [4, 3, 2, 1]
    assert verify(make_schedule("1f1b", 4, 2)).max_inflight == [2, 2, 2, 1]
    # Interleaved (Megatron's order): warm-up 2(p-r-1) + (v-1)p, plus one.
    assert verify(make_schedule("interleaved", 4, 8, 2)).max_inflight == [11, 9, 7, 5]
    assert verify(forward_only(4, 8, 2)).max_inflight == [0, 0, 0, 0]


def test_gpipe_and_1f1b_lose_nothing_to_blocking_sends():
    for kind in ("gpipe", "1f1b"):
        for p, m in ((2, 3), (4, 8), (8, 5)):
            report = verify(make_schedule(kind, p, m))
            assert report.rendezvous_makespan == report.makespan
            assert simulate(report.schedule, comm="rendezvous").makespan == report.makespan


# ---- generator shapes ------------------------------------------------------------
def test_1f1b_order_is_pipedream_flush():
    s = make_schedule("1f1b", 3, 4)
    assert [str(a) for a in s.compute(0)] == "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3".split()
    assert [str(a) for a in s.compute(2)] == "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3".split()


def test_interleaved_order_is_megatrons():
    s = make_schedule("interleaved", 2, 4, 2)
    # Groups of p=2 microbatches; chunk 0 then chunk 2 within a group; warm-up 2*1 + 1*2 = 4.
    assert [str(a) for a in s.compute(0)] == (
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3".split())
    assert s.chunks_of(1) == [1, 3] and s.stage_of(3) == 1


def test_interleaved_remainder_is_handled():
    assert microbatch_groups(8, 4) == [4, 4]        # Megatron's groups when p divides m
    assert microbatch_groups(10, 4) == [5, 5]
    assert microbatch_groups(7, 4) == [7]
    assert microbatch_groups(3, 4) == [3]
    report = verify(make_schedule("interleaved", 4, 10, 2))
    assert report.bubble_ratio == pytest.approx(3 / 20)


def test_gpipe_runs_all_forwards_first():
    s = make_schedule("gpipe", 2, 3)
    assert [str(a) for a in s.compute(1)] == "F1.0 F1.1 F1.2 B1.0 B1.1 B1.2".split()


def test_communication_endpoints():
    s = make_schedule("interleaved", 2, 2, 2)      # 4 chunks: stage 1 sends chunk 1 -> chunk 2 on stage 0
    acts = {str(a) for a in s.actions[1]}
    assert {"sa1.0>0", "ra3.0<0", "rg1.0<0", "sg3.0>0"} <= acts
    assert "ra0.0<1" not in {str(a) for a in s.actions[0]}   # chunk 0 reads the data loader
    assert not any(a.kind is Kind.RECV_GRAD and a.chunk == 3 for a in s.actions[1])   # loss


# ---- the IR as data --------------------------------------------------------------
def test_action_text_round_trip():
    for text in ("F3.1", "B0.12", "sa3.1>2", "ra4.1<3", "sg3.1>2", "rg2.1<3"):
        assert str(parse_action(text)) == text
    assert parse_action("sa3.1>2").message == parse_action("ra4.1<3").message == ("act", 3, 1)
    assert parse_action("sg3.1>2").message == parse_action("rg2.1<3").message == ("grad", 3, 1)
    for bad in ("X1.1", "F1.1>2", "sa1.1", "ra1.1>0"):
        with pytest.raises(PlanError):
            parse_action(bad)


def test_schedule_json_round_trip():
    s = make_schedule("interleaved", 4, 6, 3)
    again = Schedule.from_json(json.loads(json.dumps(s.to_json())))
    assert again == s


# ---- the verifier rejects what is wrong ------------------------------------------
def _edit(schedule, rank, new_list):
    actions = [list(a) for a in schedule.actions]
    actions[rank] = [parse_action(t) if isinstance(t, str) else t for t in new_list]
    return dataclasses.replace(schedule, actions=actions)


def _naive_1f1b(p, m):
    """1F1B with each receive right before its consumer and each send right after its producer."""
    s = make_schedule("1f1b", p, m)
    last = p - 1
    lists = []
    for r in range(p):
        out = []
        for a in s.compute(r):
            if a.kind is Kind.FORWARD:
                out += [Action(Kind.RECV_ACT, a.chunk, a.mb, r - 1)] if a.chunk > 0 else []
                out += [a] + ([Action(Kind.SEND_ACT, a.chunk, a.mb, r + 1)] if a.chunk < last else [])
            else:
                out += [Action(Kind.RECV_GRAD, a.chunk, a.mb, r + 1)] if a.chunk < last else []
                out += [a] + ([Action(Kind.SEND_GRAD, a.chunk, a.mb, r - 1)] if a.chunk > 0 else [])
        lists.append(out)
    return dataclasses.replace(s, actions=lists)


def test_naive_send_recv_order_deadlocks_with_blocking_sends():
    naive = _naive_1f1b(2, 3)
    assert simulate(naive).makespan == 12         # fine if sends are buffered ...
    with pytest.raises(ScheduleError, match=r"deadlocks.*rank 0 at sa0\.1>1.*rank 1 at sg1\.0>0"):
        verify(naive)                              # ... but not if they block


def test_verifier_names_the_violation():
    s = make_schedule("1f1b", 2, 2)
    r0 = [str(a) for a in s.actions[0]]
    r1 = [str(a) for a in s.actions[1]]
    # Sends to rank 1 in an order rank 1 does not receive them.
    i, j = r0.index("sa0.0>1"), r0.index("sa0.1>1")
    swapped = list(r0)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match="output is sent before it runs|message 0 from rank 0"):
        verify(_edit(s, 0, swapped))
    # Backward before forward.
    bad = [t for t in r1 if t != "B1.0"]
    bad.insert(0, "B1.0")
    with pytest.raises(ScheduleError, match=r"rank 1, action B1.0: runs before F1.0"):
        verify(_edit(s, 1, bad))
    # A missing receive.
    with pytest.raises(ScheduleError, match=r"ra1.1<0 is missing from rank 1"):
        verify(_edit(s, 1, [t for t in r1 if t != "ra1.1<0"]))
    # A chunk on the wrong rank.
    with pytest.raises(ScheduleError, match=r"chunk 1 does not live on rank 0"):
        verify(_edit(s, 0, r0 + ["F1.0"]))
    # A wrong peer.
    with pytest.raises(ScheduleError, match=r"peer must be stage 1"):
        verify(_edit(s, 0, [t.replace("sa0.0>1", "sa0.0>0") for t in r0]))
    # Backward in a forward-only schedule.
    f = forward_only(2, 2)
    with pytest.raises(ScheduleError, match="forward-only"):
        verify(_edit(f, 1, [str(a) for a in f.actions[1]] + ["B1.0"]))


def test_verifier_checks_the_inflight_bound():
    gpipe = make_schedule("gpipe", 4, 8)
    with pytest.raises(ScheduleError, match=r"rank 0 holds 8 activations \(at most 4"):
        verify(dataclasses.replace(gpipe, name="1f1b"))


# ---- durations -------------------------------------------------------------------
def test_cost_model_durations():
    s = make_schedule("1f1b", 2, 4)
    equal = verify(s, {0: (1, 2), 1: (1, 2)})
    assert equal.makespan == verify(s).makespan == 15
    slow = verify(s, {0: (1.0, 2.0), 1: (2.0, 4.0)})   # the last stage is the bottleneck
    assert slow.makespan == 1 + 4 * 6 + 2      # F0.0, then stage 1 never idles, then B0.3
    assert slow.simulation.busy == [12.0, 24.0]
    # A callable may also charge communication, which the bubble counts as idle.
    comm = simulate(s, lambda a: 0.5 if a.is_send else (1 if a.kind is Kind.FORWARD else 2 if a.is_compute else 0))
    assert comm.makespan > 15 and comm.bubble_ratio > 1 / 4
    with pytest.raises(PlanError, match="chunk 1"):
        simulate(s, {0: (1, 2)})


def test_simulation_times_are_consistent():
    s = make_schedule("interleaved", 3, 6, 2)
    sim = simulate(s)
    for r, acts in enumerate(s.actions):
        for k, a in enumerate(acts):
            assert sim.start[r][k] <= sim.end[r][k]
            if k:
                assert sim.end[r][k - 1] <= sim.start[r][k]


# ---- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("kind,pp,m,v,words", [
    ("1f1b", 0, 4, 1, "pp=0"), ("1f1b", 2, 0, 1, "m=0"), ("1f1b", 2, 4, 2, "interleaved"),
    ("gpipe", 2, 4, 3, "interleaved"), ("zigzag", 2, 4, 1, "unknown"), ("interleaved", 1, 4, 2, "pp>=2"),
    ("1f1b", 2, 4, 0, "v=0"),
])
def test_bad_input_is_a_plan_error(kind, pp, m, v, words):
    with pytest.raises(PlanError, match=words):
        make_schedule(kind, pp, m, v)


# ---- CLI -------------------------------------------------------------------------
def test_cli_text(capsys):
    assert main(["schedule", "--pp", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "rank 3" in out and "F0.7" in out and "B3.7" in out
    assert "bubble fraction     0.2727" in out and "(p-1)/(v*m) = 0.3750" in out


def test_cli_json_and_svg(capsys, tmp_path):
    svg = tmp_path / "t.svg"
    assert main(["schedule", "--pp", "4", "-m", "8", "-v", "2", "--schedule", "interleaved",
                 "--json", "--svg", str(svg)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"schedule", "pp", "microbatches", "interleave", "bubble_fraction", "makespan",
            "max_inflight"} <= set(data)
    assert data["schedule"] == "interleaved" and data["interleave"] == 2
    assert data["bubble_ratio"] == pytest.approx(3 / 16)
    assert data["max_inflight"] == [11, 9, 7, 5]
    text = svg.read_text()
    assert text.startswith("<svg") and "F7.7 on rank 3" in text and text.rstrip().endswith("</svg>")


@pytest.mark.parametrize("argv", [
    ["--pp", "0", "-m", "4"], ["--pp", "2", "-m", "0"], ["--pp", "2", "-m", "4", "-v", "2"],
    ["--pp", "2", "-m", "4", "--schedule", "zigzag"], ["--pp", "two", "-m", "4"],
])
def test_cli_bad_input_exits_2(argv, capsys):
    try:
        code = main(["schedule", *argv])
    except SystemExit as exc:          # argparse rejects a non-integer itself
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
