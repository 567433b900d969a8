"""Plan key compile=inductor (runtime/compiled.py): parity with one process, fallback, bad values.

The default run keeps one 2-rank job (tp=2 and pp=2 1F1B, each chunk compiled by Inductor);
the matrix over every plan family is `-m zoo` (a first Inductor compile on a loaded 2-core
machine takes tens of seconds per chunk: models are tiny and plans few).
"""
import pytest
import torch

import threefold
from threefold.plan import Plan
from threefold.runtime.launch import launch
from tests.parity import load_workload, max_rel_diff, parallel_losses, parallel_sgd_losses, reference_losses

STEPS = 3
GPT = ("gpt", {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8})
# interleaved and zbv cut 2 chunks per stage: 4 layers
GPT4 = ("gpt", {"n_layer": 4, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8})


def test_compile_key_round_trips_and_bad_values_are_one_line_plan_errors():
    plan = Plan.parse("pp=2,compile=inductor")
    assert plan.compile == "inductor" and Plan.parse(str(plan)) == plan
    assert Plan.parse("pp=2,compile=none").compile == "none" and "compile" not in str(Plan.parse("compile=none"))
    with pytest.raises(threefold.PlanError, match="compile='xla' is invalid.*compile=inductor"):
        Plan.parse("compile=xla")


def test_a_graph_inductor_cannot_compile_runs_eagerly_with_a_note(monkeypatch, capsys):
    """Inductor failing on a graph (an op it cannot lower) is a one-line note and the eager
    FX graph, never a crash; the losses are still the single-process ones."""
    import torch._inductor.compile_fx as compile_fx

    def refuse(gm, example_inputs, *args, **kwargs):
        raise NotImplementedError("no lowering for aten.fancy_op")
    monkeypatch.setattr(compile_fx, "compile_fx", refuse)
    torch._dynamo.reset()
    factory, kwargs = GPT
    ref = reference_losses(factory, kwargs, STEPS)
    w = load_workload(factory, **kwargs)
    pm = threefold.parallelize(w["model"], "compile=inductor", w["inputs"], w["loss_fn"], target=w["target"])
    got = parallel_sgd_losses(pm, w, STEPS)
    torch._dynamo.reset()
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)
    notes = [line for line in capsys.readouterr().err.splitlines() if "compile=inductor" in line]
    assert notes and "Inductor cannot compile it (NotImplementedError: no lowering for aten.fancy_op)" in notes[0]


def _check(world, plans, workload, tol=1e-5):
    factory, kwargs = workload
    ref = reference_losses(factory, kwargs, STEPS)
    results = launch(parallel_losses, world, plans, factory, kwargs, STEPS, timeout=1500)
    for rank_result in results:
        for r in rank_result:
            assert max_rel_diff(r["losses"], ref) < tol, (r["plan"], r["losses"], ref)
    for i in range(len(plans)):   # the loss is the same on every rank
        assert len({tuple(rr[i]["losses"]) for rr in results}) == 1


def _losses_and_graphs(plans: list[str]):
    """Each plan's losses and the graphs Dynamo compiled for it (its counters' growth)."""
    import torch._dynamo.utils as dynamo_utils
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    factory, kwargs = GPT
    out = []
    for plan in plans:
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        w = load_workload(factory, **kwargs)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        losses = parallel_sgd_losses(pm, w, STEPS)
        out.append({"plan": plan, "losses": losses, "graphs": dynamo_utils.counters["stats"]["unique_graphs"] - before})
    return out


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_inductor_chunks_match_single_process_under_tp_and_pp():
    """tp=2 (collectives inside the chunk: graph breaks) and pp=2 1F1B (boundaries).

    Each chunk really compiles: a tp chunk's first helper call is a collective, and the
    helpers' eager wrappers are made before tracing (made lazily, Dynamo met a
    torch.compiler.disable call while tracing, gave up on the frame and the tp chunk ran
    wholly eagerly: 0 graphs, same losses)."""
    factory, kwargs = GPT
    ref = reference_losses(factory, kwargs, STEPS)
    results = launch(_losses_and_graphs, 2, ["tp=2,compile=inductor", "pp=2,m=2,compile=inductor"], timeout=1500)
    for rank_result in results:
        for r in rank_result:
            assert max_rel_diff(r["losses"], ref) < 1e-5, (r["plan"], r["losses"], ref)
        tp, pp = rank_result
        assert tp["graphs"] >= 4, tp   # measured: 11 graphs between the collectives of 2 layers
        assert pp["graphs"] >= 1, pp   # one graph per chunk
    for i in range(2):   # the loss is the same on every rank
        assert len({tuple(rr[i]["losses"]) for rr in results}) == 1


# every plan family with compile=inductor, 2 ranks each (tp, pp 1F1B are the default run's)
ZOO_PLANS = [
    ("tp=2,sp=true,compile=inductor", GPT),
    ("pp=2,m=4,v=2,schedule=interleaved,compile=inductor", GPT4),
    ("pp=2,m=4,schedule=zbv,compile=inductor", GPT4),
    ("pp=2,m=2,schedule=zb-h1,compile=inductor", GPT),
    ("dp=2,m=2,compile=inductor", GPT),
    ("dp=2,zero=1,compile=inductor", GPT),
    ("dp=2,zero=3,compile=inductor", GPT),
    ("pp=2,m=2,recompute=full,compile=inductor", GPT),
    ("tp=2,recompute=selective,compile=inductor", GPT),
]


@pytest.mark.zoo
@pytest.mark.timeout(1600)
@pytest.mark.parametrize("plan,workload", ZOO_PLANS, ids=[p for p, _ in ZOO_PLANS])
def test_every_plan_family_matches_single_process_compiled(plan, workload):
    _check(2, [plan], workload)


@pytest.mark.zoo
@pytest.mark.timeout(1600)
def test_bf16_compiled_matches_single_process_autocast_within_rounding_noise():
    """Inductor under autocast: within the rounding noise of bf16 (tests/test_precision.py's rule)."""
    import math
    from tests.precision_runs import parallel, reference, rounding_noise
    gpt = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8}
    plans = ["tp=2,dtype=bf16,compile=inductor", "pp=2,m=2,dtype=bf16,compile=inductor"]
    ref = reference("gpt", gpt, STEPS, "sgd", torch.bfloat16)
    fp32 = reference("gpt", gpt, STEPS, "sgd")
    tol = [4 * math.sqrt(2) * s for s in rounding_noise("gpt", gpt, STEPS, "sgd", torch.bfloat16, draws=6)]
    results = launch(parallel, 2, plans, "gpt", gpt, STEPS, "sgd", timeout=1500)
    for r in results[0]:
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref)]
        assert all(d <= t for d, t in zip(diffs, tol)), (r["plan"], diffs, tol)
        assert r["losses"] != fp32, r["plan"]   # it really computed in bf16


def test_cpu_graphs_compile_with_the_cpp_wrapper_and_others_with_inductors_defaults():
    """The C++ wrapper (runtime/compiled.py config_patches) is for CPU graphs only."""
    from threefold.runtime.compiled import config_patches
    assert config_patches([torch.ones(2), 3]) == {"cpp_wrapper": True}
    assert config_patches([torch.ones(2, device="meta")]) == {}
    assert config_patches([torch.ones(2), torch.ones(2, device="meta")]) == {}

