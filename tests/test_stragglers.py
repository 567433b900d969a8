"""A rank that is only slow is named (which rank, how slow), once per streak, and never
stopped (train/stragglers.py)."""
import time

import pytest

from threefold.train import stragglers
from threefold.train.stragglers import FACTOR, STREAK, WARMUP, StragglerWatch, describe


class _Engine:
    device = "cpu"
    modules = {}


class _PM:
    engine = _Engine()


def _watch(monkeypatch, rows):
    feed = iter(rows)
    monkeypatch.setattr(stragglers, "_gather", lambda value, device=None: next(feed))
    return StragglerWatch(_PM())


def test_a_rank_slow_for_a_streak_is_named_once(monkeypatch):
    usual = [[0.05, 0.10, 0.05]] * (WARMUP + 1)
    slow = [[0.05, 0.10 * (FACTOR + 1), 0.05]] * (STREAK + 2)
    w = _watch(monkeypatch, usual + slow + usual)
    found = [w.end_step(s + 1) for s in range(len(usual) * 2 + len(slow))]
    named = [f for f in found if f]
    assert len(named) == 1 and named[0]["rank"] == 1, named
    assert named[0]["times"] == pytest.approx(FACTOR + 1) and named[0]["usual_seconds"] == pytest.approx(0.10)
    assert "rank 1 is a straggler" in describe(named[0])


def test_everyone_slower_together_or_a_blip_is_not_a_straggler(monkeypatch):
    usual = [[0.05, 0.05]] * (WARMUP + 1)
    together = [[0.5, 0.5]] * (STREAK + 2)       # the machine got busy: every rank
    blip = [[0.05, 0.5]] * (STREAK - 1) + [[0.05, 0.05]]
    w = _watch(monkeypatch, usual + together + blip)
    assert not any(w.end_step(s + 1) for s in range(len(usual) + len(together) + len(blip)))


def _slow_rank_job(victim: int, from_step: int, steps: int):
    import torch

    import threefold
    from tests.parity import load_workload
    torch.set_num_threads(1)
    w = load_workload("gpt", n_layer=2, n_embd=16, n_head=2, seq=8, batch=4)
    pm = threefold.parallelize(w["model"], "pp=2,m=2", w["inputs"], w["loss_fn"], target=w["target"])
    watch = StragglerWatch(pm)
    calls = {"step": 0}
    if torch.distributed.get_rank() == victim:
        for mod in pm.engine.modules.values():
            def slowed(*a, _f=mod.forward, **k):
                if calls["step"] >= from_step:
                    time.sleep(0.3)
                return _f(*a, **k)
            mod.forward = slowed
            watch = StragglerWatch(pm)     # measures the slowed forward, as a slow chip would run
    found = []
    for s in range(steps):
        calls["step"] = s + 1
        pm.step(*w["inputs"], target=w["target"])
        f = watch.end_step(s + 1)
        if f:
            found.append(f)
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_slowed_rank_is_reported_by_every_rank_and_training_goes_on():
    from threefold.runtime.launch import launch
    steps = 1 + WARMUP + 2 + STREAK + 1
    results = launch(_slow_rank_job, 2, 1, 1 + WARMUP + 2, steps, timeout=280)
    for found in results:
        assert len(found) == 1 and found[0]["rank"] == 1, found
        assert found[0]["times"] > FACTOR
