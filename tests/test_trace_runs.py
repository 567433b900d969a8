"""Tracing real runs on local gloo ranks: every rank's trace of a traced step holds each
action of its schedule once, in the schedule's order; it is valid trace-event JSON; the
clocks of ranks on one host come out aligned within the measured round trip; tracing does
not change a single loss and an untraced step reads no clock; and `threefold train --trace`,
`threefold run --trace` and THREEFOLD_TRACE=DIR write what they say."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import threefold
from tests.parity import ROOT, load_workload
from tests.test_trace import check_trace_event_format
from threefold.runtime.trace_stats import schedule_order_problems, summarize

TINY = dict(n_layer=4, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=8)


def _job(plan: str, trace_dir: str):
    """3 SGD steps untraced, then 3 with THREEFOLD_TRACE=DIR tracing steps 2 and 3; the
    losses of both, and the clock reads of the traced module's untraced step 1."""
    import threefold.runtime.trace as trace_mod
    torch.set_num_threads(1)
    runs = []
    for traced in (False, True):
        w = load_workload("gpt", **TINY)
        if traced:
            os.environ.update(THREEFOLD_TRACE=trace_dir, THREEFOLD_TRACE_STEPS="2,3")
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        for k in ("THREEFOLD_TRACE", "THREEFOLD_TRACE_STEPS"):
            os.environ.pop(k, None)
        opt = pm.optimizer(torch.optim.SGD, lr=0.1)
        reads, real = [], trace_mod.clock
        losses = []
        for k in range(1, 4):
            if k == 1:
                trace_mod.clock = lambda: reads.append(1) or real()
            opt.zero_grad()
            losses.append(pm.step(*w["inputs"], target=w["target"]))
            opt.step()
            trace_mod.clock = real
        runs.append({"losses": losses, "reads_untraced": len(reads)})
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["pp=2,m=4", "pp=2,m=4,schedule=zbv", "tp=2,pp=2,m=2,schedule=interleaved,v=2"])
def test_traced_steps_follow_the_schedule(plan, tmp_path, monkeypatch):
    world = threefold.Plan.parse(plan).world_size
    gloo = "tp=2" in plan   # this case's pipeline messages through gloo, not shared memory
    if gloo:
        monkeypatch.setenv("THREEFOLD_LOCAL_P2P", "0")
    result = threefold.launch(_job, world, plan, str(tmp_path / "env"))
    plain, traced = result[0]
    assert plain["losses"] == traced["losses"]         # tracing changes nothing
    assert all(r[1]["reads_untraced"] == 0 for r in result)   # an untraced step reads no clock
    t = json.load(open(tmp_path / "env" / "trace.json"))   # THREEFOLD_TRACE=DIR, written by rank 0
    check_trace_event_format(t)
    assert schedule_order_problems(t) == []
    assert t["otherData"]["steps"] == [2, 3]
    pids = {e["pid"] for e in t["traceEvents"] if e["ph"] == "X"}
    assert pids == set(range(world))
    names = {e["name"] for e in t["traceEvents"] if e["ph"] == "X"}
    assert any(n.startswith("all-reduce (posted): the loss") for n in names)
    assert any(re.match(r"s[ag]\d+\.\d+>\d+$", n) for n in names)     # the send actions
    if gloo:   # (a send through shared memory is complete when posted: no wait to trace)
        assert any(n.startswith("send wait:") for n in names)
    if "tp=2" in plan:
        assert any("tensor-parallel" in n for n in names)
    # ranks on one host share one monotonic clock: the true offset is 0, and round-trip
    # alignment puts it within half the round trip
    sync = t["otherData"]["clock_sync"]
    for off, trip in zip(sync["offset_ns"], sync["round_trip_ns"]):
        assert abs(off) <= trip / 2 + 1000, sync
    s = summarize(t)
    m = s["measured"]
    assert 0 < m["bubble_fraction"] < 1 and 0 <= s["simulated"]["bubble_fraction"] < 1
    assert all(b > 0 for b in m["busy_s"])
    assert m["idle_s"] == pytest.approx([m["window_s"] - b for b in m["busy_s"]])
    assert s["tracer"]["worst_share_of_step"] < 0.2
    assert "Measured timeline" in (tmp_path / "env" / "trace.html").read_text()


def _threefold(*args, timeout=500):
    return subprocess.run([sys.executable, "-m", "threefold", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_trace_writes_trace_and_summary(tmp_path):
    out = tmp_path / "run"
    p = _threefold("train", "--plan", "pp=2,m=2", "--steps", "3", "--batch", "4", "--seq", "16",
                   "--n-layer", "2", "--n-embd", "32", "--eval-every", "0", "--sample-tokens", "0",
                   "--trace", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "bubble: measured" in p.stdout and "simulated" in p.stdout and "idle per rank" in p.stdout
    t = json.load(open(out / "trace.json"))
    check_trace_event_format(t)
    assert t["otherData"]["steps"] == [3] and schedule_order_problems(t) == []
    names = {e["name"] for e in t["traceEvents"] if e["ph"] == "X"}
    assert {"optimizer step", "clip grad norm", "step 3"} <= names
    html = (out / "trace.html").read_text()
    assert "Measured vs simulated bubble" in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_trace_writes_beside_the_artifact(tmp_path):
    art = tmp_path / "art"
    p = _threefold("compile", "examples/gpt.py:workload(n_layer=2,n_embd=16,n_head=2,vocab_size=32,seq=8,batch=4)",
                   "--plan", "pp=2,m=2", "--out", str(art))
    assert p.returncode == 0, p.stderr[-2000:]
    p = _threefold("run", str(art), "--steps", "2", "--trace", "--trace-steps", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "bubble: measured" in p.stderr
    t = json.load(open(str(art) + ".trace/trace.json"))
    assert t["otherData"]["steps"] == [2] and schedule_order_problems(t) == []
    p = _threefold("run", str(art), "--steps", "2", "--trace", "--trace-steps", "3")
    assert p.returncode == 2 and "--trace-steps 3 goes past --steps 2" in p.stderr


def test_train_trace_steps_past_the_run_is_one_line(tmp_path, capsys):
    from threefold.cli.main import main
    assert main(["train", "--steps", "2", "--trace", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "trace_steps" in err.replace("-", "_") and len(err.strip().splitlines()) == 1, err
