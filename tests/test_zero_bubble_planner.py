"""The cost model's B/W split and the planner's zero-bubble candidates."""
from __future__ import annotations

import pytest

from threefold.plan import Plan
from threefold.planner.cluster import load_cluster
from threefold.planner.constraints import Constraints
from threefold.planner.estimate import Config, estimate
from threefold.planner.gpt_cost import gpt_model_cost
from threefold.planner.search import legal_configs, rank_plans
from threefold.planner.timeline import plan_simulation
from threefold.planner.zero_bubble_time import bubble_seconds, pipeline_seconds
from threefold.runtime.schedule import Kind


@pytest.fixture(scope="module")
def a100():
    return load_cluster("a100-80gb")


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_bubble_forms_are_the_simulated_runtime_orders(p):
    """With T_F = T_B = T_W per chunk the closed forms equal the simulation of the runtime's order."""
    for m in (2 * p, 3 * p + 1):
        assert pipeline_seconds("zb-h1", p, m, 1, [(1.0, 1.0, 1.0)] * p) == 3 * m + bubble_seconds("zb-h1", p, 1, 1, 1)
        # a ZB-V stage holds two chunks: one microbatch's F on a stage is two chunk forwards
        assert pipeline_seconds("zbv", p, m, 2, [(1.0, 1.0, 1.0)] * p) == 6 * m + bubble_seconds("zbv", p, 2, 2, 2)
    assert bubble_seconds("zb-h1", p, 1, 1, 1) == p - 1 and bubble_seconds("zbv", p, 2, 2, 2) == p - 1


def test_extrapolated_simulation_matches_the_full_one():
    times = [(1.0, 1.3, 0.7), (1.1, 1.2, 0.8), (0.9, 1.1, 0.9), (1.0, 1.0, 1.0)]
    for kind, v in (("zb-h1", 1), ("zbv", 2)):
        assert pipeline_seconds(kind, 4, 40, v, times) == pytest.approx(pipeline_seconds(kind, 4, 40, v, times, cap=40))


def test_estimate_splits_backward_and_zero_bubble_wins(a100):
    model = gpt_model_cost(8, 2048, 16, seq=2048)
    base = dict(tp=1, pp=4, dp=1, microbatches=8)
    e1 = estimate(model, Config(Plan(**base, schedule="1f1b"), 8), a100)
    eh = estimate(model, Config(Plan(**base, schedule="zb-h1"), 8), a100)
    ev = estimate(model, Config(Plan(**base, schedule="zbv"), 8), a100)
    ei = estimate(model, Config(Plan(**base, interleave=2, schedule="interleaved"), 8), a100)
    # W: the weight-gradient GEMMs, a bit under half the backward (attention's bmms are all B)
    for (f, b), w in zip(eh.stage_times, eh.weight_times):
        assert 0.3 * b < w < 0.5 * b
    # ZB-H1's bubble is (p-1)(F + B - W) against 1F1B's (p-1)(F + B + W): here about half
    bubble_h1 = eh.bubble_fraction * eh.iteration_s
    bubble_1f1b = e1.bubble_fraction * e1.iteration_s
    assert 0.4 < bubble_h1 / bubble_1f1b < 0.6 and eh.iteration_s < e1.iteration_s
    assert ev.bubble_fraction < ei.bubble_fraction and ev.iteration_s < ei.iteration_s


def test_search_offers_and_chooses_zero_bubble(a100):
    model = gpt_model_cost(8, 2048, 16, seq=2048)
    schedules = {c.plan.schedule for c in legal_configs(model, 8, 8, a100)}
    assert {"1f1b", "interleaved", "zb-h1", "zbv"} <= schedules
    best = rank_plans(model, 8, 8, a100, where=Constraints(pp=4))[0]
    assert best.config.plan.schedule in ("zb-h1", "zbv")
    only = rank_plans(model, 8, 8, a100, where=Constraints(pp=4, schedule="1f1b"))
    assert {e.config.plan.schedule for e in only} == {"1f1b"}
    zbv = rank_plans(model, 8, 8, a100, where=Constraints(pp=4, schedule="zbv"))
    assert {(e.config.plan.schedule, e.config.plan.interleave) for e in zbv} == {("zbv", 2)}


def test_timeline_draws_w_with_the_weight_time(a100):
    model = gpt_model_cost(8, 2048, 16, seq=2048)
    est = estimate(model, Config(Plan(pp=4, microbatches=8, schedule="zb-h1"), 8), a100)
    sim = plan_simulation(est)
    acts = sim.schedule.actions[0]
    w = next(k for k, a in enumerate(acts) if a.kind is Kind.WEIGHT)
    assert sim.end[0][w] - sim.start[0][w] == pytest.approx(est.weight_times[0] * 1e3)


def test_chunk_cost_splits_backward_flops():
    from threefold.compiler.api import compile_workload
    from threefold.passes.cost import chunk_costs, node_cost
    from threefold.workload import Workload
    from tests.parity import load_workload
    w = load_workload("gpt", n_layer=2, n_embd=32, n_head=4, vocab_size=64, seq=8, batch=4)
    prog = compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]), Plan.parse("pp=2"))
    for c in chunk_costs(prog):
        b, wgt = c.backward_flops
        assert b + wgt == 2 * c.flops and 0 < wgt < c.flops
    linear = [n for c in prog.chunks for n in c.gm.graph.nodes
              if n.op == "call_function" and "linear" in str(n.target)]
    assert linear and all(node_cost(n).weight_grad_flops == node_cost(n).flops > 0 for n in linear)
