"""train/check compile in the parent; rank 0 takes that compile instead of repeating it,
only for the very same workload and plan."""
from __future__ import annotations

import pytest

import threefold
from threefold.compile_cache import ENV, hand_to_ranks, workload_key
from threefold.compiler import api as compiler_api
from tests.parity import load_workload

TINY = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=4)


def test_rank0_takes_the_parents_compile_for_the_same_workload_and_compiles_otherwise(monkeypatch):
    w = load_workload("gpt", **TINY)
    plan = threefold.Plan.parse("m=2")
    prog = compiler_api.compile_workload(w, plan)
    monkeypatch.setenv(ENV, "")   # (restored after the test: hand_to_ranks sets it)
    hand_to_ranks(prog, workload_key(w["model"], w["inputs"], w["target"], w["loss_fn"], plan))
    reference = threefold.parallelize(w["model"], "m=4", w["inputs"], w["loss_fn"], target=w["target"])
    calls = []
    real = compiler_api.compile_workload
    monkeypatch.setattr(compiler_api, "compile_workload", lambda *a, **k: calls.append(1) or real(*a, **k))
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    assert calls == []                                               # taken, not compiled
    loss = pm.step(*w["inputs"], target=w["target"])
    assert loss == pytest.approx(reference.step(*w["inputs"], target=w["target"]), rel=1e-6)
    other = load_workload("gpt", **{**TINY, "n_embd": 32})
    threefold.parallelize(other["model"], plan, other["inputs"], other["loss_fn"], target=other["target"])
    assert calls == [1]                                              # another model: compiled
