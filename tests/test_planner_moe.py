"""The planner knows ep: for a GPT shape whose MLPs are MoE layers (planner/moe.py's model)
the search includes ep, prices it with the same kernels-and-bytes terms as the tp-vs-ep
layer model, holds E/ep experts per rank, and picks ep exactly where that model says ep wins."""
import json
import subprocess
import sys

from threefold.planner.cluster import load_cluster
from threefold.planner.moe import MoeLayer, MoeShape, crossover_experts, layer_seconds, moe_model_cost, moe_seconds
from threefold.planner.search import best_plan, rank_plans

CLUSTER = load_cluster("h100-80gb")


def _model(experts: int, top_k: int):
    return moe_model_cost(layers=8, hidden=2048, heads=16, experts=experts, top_k=top_k, ffn=1408,
                          vocab=32000, seq=2048)


def test_moe_seconds_are_the_layer_models_terms():
    moe, n, tokens = MoeLayer(64, 2, 1408, 2048), 4, 1024
    compute, a2a = moe_seconds(moe, tokens, 1, n, CLUSTER)    # each rank its own `tokens`
    whole = layer_seconds(MoeShape(n * tokens, 2048, 1408, 64, 2), n, "ep", CLUSTER)
    assert abs(compute + a2a - whole) / whole < 1e-12


def test_plan_picks_ep_where_the_moe_model_says_ep_wins_and_not_where_it_loses():
    # top-2 of 64 experts on 8 GPUs: ep=8 moves k/n of tp's bytes and runs fat experts
    assert crossover_experts(MoeShape(4096, 2048, 1408, 64, 2), 8, CLUSTER) <= 64
    best = best_plan(_model(64, 2), batch=64, gpus=8, cluster=CLUSTER)
    assert best.config.plan.ep == 8, best.config.plan
    plans = rank_plans(_model(64, 2), 64, 8, CLUSTER)
    dense = next(e for e in plans if e.config.plan.ep == 1)
    assert best.iteration_s < dense.iteration_s
    # ep=8 holds 1/8 of the experts: its memory is below the same plan's without ep
    every = rank_plans(_model(64, 2), 64, 8, CLUSTER, include_unfit=True)
    same = next(e for e in every if e.config.plan == best.config.plan.replace(ep=1))
    assert best.memory_bytes < same.memory_bytes
    # top-8 of 8 experts: the layer model's crossover is past 8 experts, so no ep
    assert crossover_experts(MoeShape(4096, 2048, 1408, 8, 8), 8, CLUSTER) > 8
    assert best_plan(_model(8, 8), batch=64, gpus=8, cluster=CLUSTER).config.plan.ep == 1


def test_plan_cli_searches_ep_for_an_moe_shape():
    out = subprocess.run([sys.executable, "-m", "threefold", "plan", "--layers", "8", "--hidden", "2048",
                          "--heads", "16", "--experts", "64", "--top-k", "2", "--expert-ffn", "1408",
                          "--vocab", "32000", "--batch", "64", "--gpus", "8", "--cluster", "h100-80gb",
                          "--json", "--top", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert plans[0]["ep"] == 8 and "ep=8" in plans[0]["plan"]


def test_a_traced_moe_spec_is_priced_as_moe_and_the_search_includes_ep_with_zero():
    """`threefold plan SPEC` on a model (no --experts flags): the expert regions of the traced
    graph (planner/spec_moe.py) give E, k, h and f, the parameter count stays the model's, and
    the search holds ep plans (with ZeRO 0-3, never with recompute, which ep refuses)."""
    import torch
    from tests.zoo import ZOO
    from threefold.planner.spec_cost import model_cost_from_spec
    model = model_cost_from_spec("tests.zoo.hf_decoders:decoder(arch='mixtral')")
    assert model.moe == MoeLayer(experts=4, top_k=2, ffn=64, hidden=32), model.moe
    torch.manual_seed(0)
    assert model.params == sum(p.numel() for p in ZOO["mixtral"]()["model"].parameters())
    plans = rank_plans(model, 16, 4, CLUSTER, include_unfit=True)
    ep = [e.config.plan for e in plans if e.config.plan.ep > 1]
    assert {p.ep for p in ep} == {2, 4} and {p.zero for p in ep if p.ep == 2} == {0, 1, 2, 3}
    assert all(p.recompute == "none" for p in ep)
    # E/ep experts per rank: ep=2 holds less than the same plan without ep
    best = next(e for e in plans if e.config.plan.ep == 2 and e.config.plan.zero == 0)
    same = next(e for e in plans if e.config.plan == best.config.plan.replace(ep=1))
    assert best.memory_bytes < same.memory_bytes


def test_ffn_with_experts_is_the_experts_width_and_a_second_different_width_is_refused():
    """`--ffn` with `--experts` was silently ignored (each expert priced at 4h/k): with experts
    every MLP is an expert, so `--ffn` is its width; `--ffn` and `--expert-ffn` that disagree
    are one PlanError."""
    import argparse
    import pytest
    from threefold.cli.plan_cmd import model_from_args, register
    from threefold.errors import PlanError
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    flags = ["plan", "--batch", "8", "--gpus", "8", "--layers", "2", "--hidden", "256", "--heads", "4",
             "--experts", "8", "--top-k", "2"]
    by_ffn = model_from_args(parser.parse_args(flags + ["--ffn", "96"]))
    by_expert_ffn = model_from_args(parser.parse_args(flags + ["--expert-ffn", "96"]))
    default = model_from_args(parser.parse_args(flags))
    assert by_ffn.moe.ffn == by_expert_ffn.moe.ffn == 96 and default.moe.ffn == 4 * 256 // 2
    assert by_ffn.params == by_expert_ffn.params != default.params
    with pytest.raises(PlanError, match="--ffn 96 and --expert-ffn 64 disagree"):
        model_from_args(parser.parse_args(flags + ["--ffn", "96", "--expert-ffn", "64"]))
