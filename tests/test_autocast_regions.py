"""Regions under torch.autocast inside forward are traced and kept: the wrapper's arguments
are read by name (an `enabled=False` region is no longer read as enabled), the region's
casts become explicit graph nodes, and a parallel run equals one process running the same
autocast regions, within bf16's rounding noise."""
from __future__ import annotations

import pytest
import torch

from tests import autocast_models as am
from tests.parity import max_rel_diff, sgd_losses
from threefold.ir.program import tf
from threefold.compiler.trace import trace
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.runtime.launch import launch

STEPS = 3


def _casts(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default]


def _traced(enabled_region=True, plan=None):
    w = am.workload(enabled_region)
    return w, trace(w["model"], w["inputs"], w["target"], w["loss_fn"], plan)


def test_a_disabled_region_is_traced_without_casts():
    _, t = _traced(enabled_region=False)
    assert not _casts(t.gm)                       # fp32 as written: nothing to cast


def test_an_enabled_region_gets_autocasts_casts_in_the_graph():
    _, t = _traced(enabled_region=True)
    cast_of = {(n.args[0].name, next(iter(n.users)).name): n.kwargs["dtype"] for n in _casts(t.gm)}
    bf16, fp32 = torch.bfloat16, torch.float32
    # each linear's input, weight and bias go to bf16, as autocast casts a linear's operands;
    # the residual add of fp32 and bf16 computes in fp32 (type promotion, made explicit)
    assert cast_of == {("embedding", "linear"): bf16, ("p_fc1_weight", "linear"): bf16,
                       ("p_fc1_bias", "linear"): bf16, ("p_fc2_weight", "linear_1"): bf16,
                       ("p_fc2_bias", "linear_1"): bf16, ("linear_1", "add"): fp32}, cast_of


def test_the_traced_graph_computes_what_eager_autocast_computes():
    w, t = _traced(enabled_region=True)
    model, ids = w["model"], w["inputs"][0]
    expected = w["loss_fn"](model(ids), w["target"])
    values = {"ids": ids, "target": w["target"]}
    gm_inputs = [t.state[tf(n)["fqn"]] if tf(n)["kind"] in ("param", "buffer") else values[n.name]
                 for n in t.gm.graph.nodes if n.op == "placeholder"]
    got = t.gm(*gm_inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.equal(got, expected), (got, expected)


def test_a_disabled_region_under_a_bf16_plan_is_a_plan_error():
    """The plan's chunk-wide autocast would cast the region the model keeps fp32."""
    with pytest.raises(PlanError, match="enabled=False"):
        _traced(enabled_region=True, plan=Plan.parse("dtype=bf16"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_autocast_regions_parity_two_ranks():
    plans = ["tp=2", "pp=2,m=2", "dp=2,m=2"]
    ref = sgd_losses(am.workload(), STEPS)
    results = launch(am.run_plans, 2, plans, STEPS, timeout=550)
    for rank in results:
        for plan, losses in zip(plans, rank):
            # bf16 rounding of the region's matmuls over other row blocks (measured 2e-5 at
            # pp=2 and dp=2, 2e-7 at tp=2); the region's bf16 itself moves the losses 3e-5 from
            # fp32, so the casts in the graph are what the unit tests above check
            assert max_rel_diff(losses, ref) < 1e-3, (plan, losses, ref)
    assert len(set(ref)) == STEPS        # the losses move: a stuck run would fail
