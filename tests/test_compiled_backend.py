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


def _falls_back_with_a_note(monkeypatch, capsys, compile_fx_instead, error: str) -> None:
    """compile=inductor with Inductor's compile_fx replaced: the losses are still the
    single-process ones, and the first compile=inductor note says Inductor failed with `error`."""
    import torch._inductor.compile_fx as compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx", compile_fx_instead)
    torch._dynamo.reset()
    factory, kwargs = GPT
    ref = reference_losses(factory, kwargs, STEPS)
    w = load_workload(factory, **kwargs)
    pm = threefold.parallelize(w["model"], "compile=inductor", w["inputs"], w["loss_fn"], target=w["target"])
    got = parallel_sgd_losses(pm, w, STEPS)
    torch._dynamo.reset()
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)
    notes = [line for line in capsys.readouterr().err.splitlines() if "compile=inductor" in line]
    assert notes and f"Inductor cannot compile it ({error})" in notes[0], notes


def test_a_graph_inductor_cannot_compile_runs_eagerly_with_a_note(monkeypatch, capsys):
    """Inductor failing on a graph (an op it cannot lower) is a one-line note and the eager
    FX graph, never a crash; the losses are still the single-process ones."""
    def refuse(gm, example_inputs, *args, **kwargs):
        raise NotImplementedError("no lowering for aten.fancy_op")
    _falls_back_with_a_note(monkeypatch, capsys, refuse, "NotImplementedError: no lowering for aten.fancy_op")


def test_a_backward_graph_inductor_cannot_compile_runs_eagerly_with_a_note(monkeypatch, capsys):
    """The backward graph compiles with the forward (not lazily at the first backward, where
    a failure would raise inside the engine's backward call): Inductor failing on it alone
    is the same one-line note and eager graph as a forward's."""
    import torch._inductor.compile_fx as compile_fx
    real = compile_fx.compile_fx

    def refuse_backward(gm, example_inputs, *args, **kwargs):
        compile_inner = kwargs.pop("inner_compile", compile_fx.compile_fx_inner)   # (compile_fx recurses)

        def inner(g, ex, *a, **kw):
            if kw.get("is_backward"):
                raise NotImplementedError("no lowering for aten.fancy_backward")
            return compile_inner(g, ex, *a, **kw)
        return real(gm, example_inputs, *args, inner_compile=inner, **kwargs)
    _falls_back_with_a_note(monkeypatch, capsys, refuse_backward,
                            "NotImplementedError: no lowering for aten.fancy_backward")


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
        breaks = sum(dynamo_utils.counters["graph_break"].values())
        w = load_workload(factory, **kwargs)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        losses = parallel_sgd_losses(pm, w, STEPS)
        out.append({"plan": plan, "losses": losses, "graphs": dynamo_utils.counters["stats"]["unique_graphs"] - before,
                    "breaks": sum(dynamo_utils.counters["graph_break"].values()) - breaks})
    return out


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_inductor_chunks_match_single_process_under_tp_and_pp():
    """tp=2 (collectives inside the chunk) and pp=2 1F1B (boundaries).

    Each chunk really compiles, and a tp chunk into one graph: its collectives (tp_ops's f,
    g, gather, the vocab-parallel embedding and loss) are traced as functional collectives,
    not graph breaks (before: 11 graphs for 2 layers; earlier still, with the helpers'
    eager wrappers made while tracing, 0 graphs: the tp chunk ran wholly eagerly)."""
    factory, kwargs = GPT
    ref = reference_losses(factory, kwargs, STEPS)
    results = launch(_losses_and_graphs, 2, ["tp=2,compile=inductor", "pp=2,m=2,compile=inductor"], timeout=1500)
    for rank_result in results:
        for r in rank_result:
            assert max_rel_diff(r["losses"], ref) < 1e-5, (r["plan"], r["losses"], ref)
        tp, pp = rank_result
        assert tp["graphs"] == 1 and tp["breaks"] == 0, tp   # the tp chunk: one graph, collectives in it
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


def test_cpu_graphs_with_an_all_gather_compile_with_the_python_wrapper():
    """Inductor's C++ wrapper calls a functional all-reduce but not an all-gather (torch
    2.13): a graph with one anywhere, an autograd.Function's subgraph included, keeps the
    Python wrapper."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)
    from threefold.runtime.compiled import config_patches
    ops = torch.ops._c10d_functional

    def graph(collective=None, nested=False) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.relu.default, (x,))
        if collective == "all_reduce":
            y = g.call_function(ops.all_reduce, (y, "sum", "0"))
        elif collective == "all_gather":
            y = g.call_function(ops.all_gather_into_tensor, (y, 2, "0"))
        if collective:
            y = g.call_function(ops.wait_tensor, (y,))
        g.output(y)
        inner = torch.fx.GraphModule({}, g)
        if not nested:
            return inner
        outer = torch.fx.Graph()   # as Dynamo holds an autograd.Function: its bodies are submodules
        x = outer.placeholder("x")
        outer.get_attr("bwd_body_0")
        outer.output(outer.call_function(torch.ops.aten.relu.default, (x,)))
        return torch.fx.GraphModule({"bwd_body_0": inner}, outer)
    cpp = {"cpp_wrapper": True}
    assert config_patches([torch.ones(2)], graph()) == cpp
    assert config_patches([torch.ones(2)], graph("all_reduce")) == cpp
    assert config_patches([torch.ones(2)], graph("all_gather")) == {}
    assert config_patches([torch.ones(2)], graph("all_gather", nested=True)) == {}



def test_a_failed_collective_in_a_compiled_graph_reads_as_comms_failures(monkeypatch):
    """What a dying peer leaves inside a compiled graph (the C++ wrapper's shim, or gloo's
    error) names the graph and blames the group; any other error is left alone."""
    from threefold.runtime import comm
    from threefold.runtime.comm import in_graph_failure
    monkeypatch.setattr(comm.dist, "get_rank", lambda *a: 0)          # one rank, no process group
    monkeypatch.setattr(comm.dist, "get_process_group_ranks", lambda g: [0])
    monkeypatch.setattr(comm, "posted_failure", lambda: None)
    shim = RuntimeError("aoti_torch_cpu__c10d_functional_wait_tensor(buf3, &buf6_handle) API call failed at x.cpp, line 1")
    got = in_graph_failure(shim, "chunk 0 forward")
    assert str(got) == ("rank 0: a collective in chunk 0 forward (a compiled graph) with ranks [0] failed "
                        "(its wait failed); one of ranks [0] died, failed or is stuck"), str(got)
    assert in_graph_failure(RuntimeError("shape mismatch"), "chunk 0 forward") is None
