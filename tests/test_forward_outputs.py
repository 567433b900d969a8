"""pm(x) on a model compiled with a loss returns the model's outputs, like the eager model,
under pp, tp and both (dp: each dp rank its share); training is left exactly as it was."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.foundation_helpers import workload
from threefold.codegen.python import generate_module
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch

TINY = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=4)   # vocab-parallel under tp=2


def _method(source: str, name: str) -> str:
    body = source.split(f"    def {name}(")[1]
    return body.split("\n    def ")[0]


def test_training_code_is_unchanged_and_only_forward_only_outputs_gather():
    prog = compile_workload(workload("gpt", **TINY), "tp=2,pp=2")
    last = prog.chunks[-1]
    with_outputs = generate_module(prog, last)
    without = generate_module(dataclasses.replace(prog, model_outputs=[]), last)
    # the training forward (and everything but the added method) is the same text
    assert _method(with_outputs, "forward") == _method(without, "forward")
    assert "def model_outputs(" in with_outputs and "def model_outputs(" not in without
    assert "gather" not in _method(with_outputs, "forward")
    outputs = _method(with_outputs, "model_outputs")
    assert "tp_ops.gather(lm_head" in outputs   # the vocab-parallel logits, gathered here only
    assert "cross_entropy" not in outputs and "target" not in outputs


def _outputs_vs_eager(plan: str) -> dict:
    import torch.distributed as dist

    import threefold
    from threefold.runtime import comm
    torch.set_num_threads(1)
    w = workload("gpt", **TINY)
    model, (x,), y = w["model"], w["inputs"], w["target"]
    with torch.no_grad():
        eager = model(x)
    pm = threefold.parallelize(model, plan, (x,), w["loss_fn"], target=y)
    counts = {"gathers": 0}
    real = comm.all_gather

    def counting(*a, **k):
        counts["gathers"] += 1
        return real(*a, **k)
    comm.all_gather = counting
    try:
        pm.step(x, target=y)                 # training: no gather of the logits
        in_step = counts["gathers"]
        out = pm(x)
        in_call = counts["gathers"] - in_step
    finally:
        comm.all_gather = real
    result = {"rank": dist.get_rank(), "step_gathers": in_step, "call_gathers": in_call}
    if out is not None:
        logits = out                         # a tensor, as the eager model returns
        dp_rank = pm.engine.coord.dp
        want = eager.chunk(pm.plan.dp, dim=0)[dp_rank]
        result["shape_ok"] = tuple(logits.shape) == tuple(want.shape)
        result["close"] = bool(torch.allclose(logits, want, rtol=1e-5, atol=1e-6))
        result["max_diff"] = float((logits - want).abs().max())
    return result


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("plan,world", [("pp=2,m=2", 2), ("tp=2", 2), ("tp=2,pp=2,m=2", 4), ("tp=2,dp=2", 4)])
def test_call_on_a_loss_compiled_model_equals_eager(plan, world):
    results = launch(_outputs_vs_eager, world, plan, timeout=360)
    last = [r for r in results if "close" in r]
    assert last, results
    for r in last:
        assert r["shape_ok"] and r["close"], r
    if "pp" not in plan:   # scatter/gather boundaries all-gather in training under pp
        assert all(r["step_gathers"] == 0 for r in results), results
    if "tp" in plan:       # the logits are gathered only in the forward-only call
        assert all(r["call_gathers"] > 0 for r in last), results
