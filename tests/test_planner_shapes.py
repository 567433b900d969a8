"""The planner's shape flags describe Llama-like models (GQA, SwiGLU, untied embeddings)
and agree with the SPEC path on the same model; no prediction exceeds the best measured
efficiency without saying so; ZeRO-3 pays per-layer ring latency across nodes."""
from __future__ import annotations

import dataclasses
import math

import pytest

from threefold.planner.cluster import load_cluster
from threefold.planner.constraints import Constraints
from threefold.planner.estimate import MEASURED_BEST_PEAK_FRACTION, Config, estimate
from threefold.planner.gpt_cost import gpt_model_cost
from threefold.planner.search import rank_plans
from threefold.plan import Plan


def test_llama3_70b_flags_count_its_parameters():
    model = gpt_model_cost(80, 8192, 64, 128256, 4096, ffn=28672, kv_heads=8, mlp="swiglu", tied=False)
    assert model.params / 1e9 == pytest.approx(70.55, rel=0.002)
    assert gpt_model_cost(80, 8192, 64, 128256, 4096).params / 1e9 < 66      # without the flags: GPT's shape


@pytest.mark.parametrize("bad,match", [(dict(kv_heads=3), "--kv-heads 3"), (dict(mlp="relu"), "--mlp"),
                                       (dict(ffn=0), "--ffn 0")])
def test_bad_shape_flags_are_plan_errors(bad, match):
    from threefold.errors import PlanError
    with pytest.raises(PlanError, match=match):
        gpt_model_cost(2, 64, 8, 100, 16, **bad)


def test_flags_agree_with_the_spec_path_on_the_same_llama_like_model():
    from tests.parity import load_workload
    from threefold.compiler.trace import trace
    from threefold.planner.spec_cost import model_cost_from_program
    L, H, A, KV, F, V, S = 2, 4096, 32, 8, 14336, 32000, 4096      # Llama-2-7B's layer, two of them
    w = load_workload("llama", n_layer=L, hidden=H, n_head=A, n_kv_head=KV, intermediate=F, vocab_size=V, seq=S, batch=1,
              device="meta", attn="sdpa")
    spec = model_cost_from_program(trace(w["model"], w["inputs"], w["target"], w["loss_fn"]), w["inputs"], "llama")
    flags = gpt_model_cost(L, H, A, V, S, ffn=F, kv_heads=KV, mlp="swiglu", tied=False)
    assert flags.params == spec.params
    h100 = load_cluster("h100-80gb")
    best = [rank_plans(m, 64, 8, h100)[0] for m in (spec, flags)]
    assert str(best[0].config.plan) == str(best[1].config.plan)
    assert best[1].model_s == pytest.approx(best[0].model_s, rel=0.05)
    for where in ("tp=2,pp=1,recompute=selective", "tp=1,pp=2"):
        a, b = (rank_plans(m, 64, 8, h100, where=Constraints.parse(where), include_unfit=True)[0] for m in (spec, flags))
        assert b.model_s == pytest.approx(a.model_s, rel=0.05), where


@pytest.mark.parametrize("model", ["llama7b", "mixtral", pytest.param("llama3-70b", marks=pytest.mark.slow)])
def test_flags_and_spec_agree_within_5_percent_on_every_plan_at_every_tp_and_pp(model):
    """The same model both ways (a Hugging Face Llama or Mixtral built on the meta device,
    four layers of the real width): every plan the search ranks on 64 H100s, at every tp in
    1, 2, 4, 8 and pp in 1, 2, 4, is priced within 5% by the shape flags and by the SPEC path.
    They agree because both price the kernels a GPU run executes (the fusion pass's regions,
    one loss kernel, flash attention with nothing for recompute=selective to rerun, the MoE's
    routing and its all-reduce of k rows per token) and read nothing else differently."""
    from tests.bench_scripts import load
    bench = load("planner_flags_vs_spec")
    spec, flags = bench.both_costs(bench.SHAPES[model], layers=4)
    assert flags.params == spec.params        # no biases in a swiglu layer, RMSNorm weights of h
    ratios = bench.ratios(spec, flags, batch=64, gpus=64, cluster=load_cluster("h100-80gb"))
    assert set(ratios) == {(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4)}
    worst = {tp_pp: max(abs(r - 1) for r in rs) for tp_pp, rs in ratios.items()}
    assert max(worst.values()) < 0.05, worst
    # memory per GPU too: both count saved activations by planner/saved_bytes.py's rules on a
    # graph (the flags on the decoder they describe, planner/reference_layer.py)
    memory = bench.memory_ratios(spec, flags, batch=64, gpus=64, cluster=load_cluster("h100-80gb"))
    assert set(memory) == set(ratios)
    worst = {tp_pp: max(abs(r - 1) for r in rs) for tp_pp, rs in memory.items()}
    assert max(worst.values()) < 0.05, worst


def test_flags_and_spec_pick_the_same_best_plan_for_llama3_70b_on_64_h100():
    """Llama-3-70B, batch 512 on 64 H100s: the shape flags and the SPEC path (four traced
    layers of the real width, the per-layer figures applied to all 80) rank the same plan
    first, predict it within 5% and give it the same memory within 5% (before they shared
    one count of saved activations the flags chose tp=2,pp=1 at 0.69-1.76x the SPEC's
    memory)."""
    from tests.bench_scripts import load
    bench = load("planner_flags_vs_spec")
    spec, flags = bench.both_costs(bench.SHAPES["llama3-70b"], layers=4)
    spec, flags = bench.full_depth(spec, flags, bench.SHAPES["llama3-70b"])
    assert spec.layers == flags.layers == 80
    assert flags.params == pytest.approx(spec.params, rel=2e-3)
    h100 = load_cluster("h100-80gb")
    best = [rank_plans(m, 512, 64, h100)[0] for m in (spec, flags)]
    assert str(best[0].config.plan) == str(best[1].config.plan)
    assert best[0].config.microbatch_size == best[1].config.microbatch_size
    assert best[1].model_s == pytest.approx(best[0].model_s, rel=0.05)
    assert best[1].memory_bytes == pytest.approx(best[0].memory_bytes, rel=0.05)


def test_no_plan_is_predicted_above_the_best_measured_efficiency_and_capped_plans_say_so():
    a100 = load_cluster("a100-80gb")
    gpt3 = gpt_model_cost(96, 12288, 96)
    plans = rank_plans(gpt3, 1536, 1024, a100)
    assert all(e.peak_fraction <= MEASURED_BEST_PEAK_FRACTION + 1e-9 for e in plans)
    capped = [e for e in plans if e.capped]
    assert capped and all(e.model_s < e.iteration_s for e in capped)
    assert [e.model_s for e in plans[:5]] == sorted(e.model_s for e in plans[:5])   # ranked by the model


def test_zero3_across_nodes_pays_each_layers_ring_latency():
    a100 = load_cluster("a100-80gb")
    gpt3 = gpt_model_cost(96, 12288, 96)
    plan = Plan.parse("tp=2,pp=4,dp=128,m=12,zero=3")
    slow = estimate(gpt3, Config(plan, batch=1536), a100)
    quick = estimate(gpt3, Config(plan, batch=1536), dataclasses.replace(a100, inter_node_latency_s=0.0))
    assert slow.shares["dp"] * slow.iteration_s > quick.shares["dp"] * quick.iteration_s


def test_the_ceiling_is_the_clusters_own_device_figure_and_the_note_names_the_device():
    """The cap is a fraction of the chosen cluster's device peak: an H100 cluster is held at
    Megatron-LM's H100 figure and its note says H100 and 989 TFLOP/s, never the A100's 312."""
    from threefold.cli.plan_cmd import ceiling_note
    a100, h100 = load_cluster("a100-80gb"), load_cluster("h100-80gb")
    assert a100.measured_best_fraction == pytest.approx(163 / 312, abs=1e-4)
    assert h100.measured_best_fraction != a100.measured_best_fraction
    llama70 = gpt_model_cost(80, 8192, 64, 128256, 4096, ffn=28672, kv_heads=8, mlp="swiglu", tied=False)
    plans = rank_plans(llama70, 512, 64, h100)
    assert any(e.capped for e in plans)
    assert all(e.peak_fraction <= h100.measured_best_fraction + 1e-9 for e in plans)
    assert max(e.peak_fraction for e in plans) == pytest.approx(h100.measured_best_fraction)
    note = ceiling_note(h100, "bf16")
    assert "H100" in note and "989 TFLOP/s bf16" in note and f"{h100.measured_best_fraction:.0%}" in note
    assert "A100" not in note and "312" not in note
    note = ceiling_note(a100, "bf16")
    assert "A100" in note and "312 TFLOP/s bf16" in note and "163" in note


def test_a_cluster_file_states_its_own_ceiling_with_a_source():
    from threefold.errors import PlanError
    from threefold.planner.cluster import cluster_from_toml
    base = ("gpus_per_node = 4\nhbm_bytes = 40e9\nhbm_bandwidth = 1.5e12\nintra_node_bandwidth = 100e9\n"
            "inter_node_bandwidth = 10e9\nmatmul_fraction = 0.6\ndevice = \"X1\"\n{extra}[peak_flops]\nbf16 = 100e12\n")
    mine = cluster_from_toml(base.format(extra='measured_best_fraction = 0.4\nmeasured_best_source = "our runs"\n'))
    assert mine.measured_best_fraction == 0.4 and mine.device_name == "X1"
    default = cluster_from_toml(base.format(extra=""))   # no figure: the paper's A100 one, said so
    assert default.measured_best_fraction == 163 / 312 and "A100" in default.measured_best_source
    with pytest.raises(PlanError, match="measured_best_source"):
        cluster_from_toml(base.format(extra="measured_best_fraction = 0.4\n"))
    with pytest.raises(PlanError, match="measured_best_fraction = 1.5"):
        cluster_from_toml(base.format(extra='measured_best_fraction = 1.5\nmeasured_best_source = "x"\n'))


def test_plan_cli_on_h100_cites_the_h100_ceiling(capsys):
    # batch 1024: its best plans are held at the ceiling (at 512 the best fitting plan is
    # predicted just under it, so no note)
    import json
    from threefold.cli.main import main
    args = ["plan", "--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--ffn", "28672",
            "--mlp", "swiglu", "--no-tied", "--vocab", "128256", "--seq", "4096", "--batch", "1024", "--gpus", "64",
            "--cluster", "h100-80gb", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "* held at 47% of the H100 80GB SXM5's 989 TFLOP/s bf16 peak" in out and "312" not in out
    assert main(args + ["--json"]) == 0
    ceiling = json.loads(capsys.readouterr().out)["ceiling"]
    assert ceiling["device"].startswith("H100") and ceiling["peak_fraction"] == 0.47


@pytest.mark.slow
def test_a100_matmul_fraction_is_the_least_squares_fit_to_the_measured_runs():
    """The preset's one fitted constant is the minimum of planner/calibrate.loss over the
    paper's Table 1 and its 175B figure (not a hand-tuned number): moving it either way by
    0.005 fits worse; at it every run is predicted within 8% (mean under 3%) where the prior
    0.7 was 11% off on average; the ceiling holds every prediction at or below 163 TFLOP/s."""
    from threefold.planner.calibrate import loss, row_errors, row_prediction
    from threefold.planner.paper_table1 import MEASURED_ROWS
    a100 = load_cluster("a100-80gb")
    f = a100.matmul_fraction
    errors = row_errors(MEASURED_ROWS, a100)
    at = sum(math.log(1 + e) ** 2 for e in errors)
    assert at <= loss(MEASURED_ROWS, a100, f - 0.005) and at <= loss(MEASURED_ROWS, a100, f + 0.005)
    assert max(map(abs, errors)) < 0.08 and sum(map(abs, errors)) / len(errors) < 0.03
    prior = row_errors(MEASURED_ROWS, dataclasses.replace(a100, matmul_fraction=0.7))
    assert sum(map(abs, prior)) / len(prior) > 0.10
    assert all(row_prediction(r, a100).tflops_per_gpu <= 163.0 + 1e-6 for r in MEASURED_ROWS[-3:])
