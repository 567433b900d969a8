"""Parity: pipeline/data-parallel training equals single-process training (3 SGD steps, fp32).

Plans of one world size run in one launched job to pay process start-up once.
"""
import pytest

from threefold.plan import Plan
from threefold.runtime.launch import launch
from tests.parity import max_rel_diff, parallel_losses, reference_losses

STEPS = 3
# 5 layers: uneven splits on pp=2 and pp=4; examples/gpt.py ties lm_head to wte.
GPT = ("gpt", {"n_layer": 5, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8})


def _plans(pp, dp):
    m = 4
    return [f"pp={pp},dp={dp},m={m},schedule=gpipe",
            f"pp={pp},dp={dp},m={m},schedule=1f1b",
            f"pp={pp},dp={dp},m={m},v=2,schedule=interleaved"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,plans", [
    (2, _plans(2, 1)),
    (4, _plans(4, 1) + _plans(2, 2)),
    (8, _plans(4, 2)),
])
@pytest.mark.slow
def test_pipeline_and_data_parallel_match_single_process(world, plans):
    factory, kwargs = GPT
    ref = reference_losses(factory, kwargs, STEPS)
    results = launch(parallel_losses, world, plans, factory, kwargs, STEPS, timeout=500)
    for rank_result in results:
        for r in rank_result:
            assert max_rel_diff(r["losses"], ref) < 1e-5, (r["plan"], r["losses"], ref)
    # The loss is identical on every rank.
    for i in range(len(plans)):
        assert len({tuple(rr[i]["losses"]) for rr in results}) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inflight_activations_respect_1f1b_bound():
    factory, kwargs = GPT
    plans = ["pp=4,m=8,schedule=1f1b", "pp=4,m=8,schedule=gpipe"]
    results = launch(parallel_losses, 4, plans, factory, kwargs, 1, timeout=250)
    for stage, rank_result in enumerate(results):
        one_f_one_b, gpipe = rank_result
        assert one_f_one_b["peak_inflight"] == 4 - stage     # p - r
        assert gpipe["peak_inflight"] == 8                   # all m microbatches


@pytest.mark.timeout(400)
@pytest.mark.parametrize("factory,kwargs", [
    ("gpt2", {"n_layer": 3, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 4}),
    ("llama", {"n_layer": 3, "hidden": 32, "n_head": 4, "n_kv_head": 2, "intermediate": 64,
               "seq": 8, "batch": 4, "tie": True}),
])
@pytest.mark.slow
def test_hf_models_pipeline_parity(factory, kwargs):
    plans = ["pp=2,m=2,schedule=1f1b", "pp=2,m=2,v=2,schedule=interleaved"]
    ref = reference_losses(factory, kwargs, STEPS)
    results = launch(parallel_losses, 2, plans, factory, kwargs, STEPS, timeout=350)
    for r in results[0]:
        assert max_rel_diff(r["losses"], ref) < 1e-5, (r["plan"], r["losses"], ref)


def test_world_size_mismatch_is_a_plan_error():
    import threefold
    from tests.parity import load_workload
    w = load_workload("gpt", n_layer=2, n_embd=16, n_head=2, seq=8, batch=4)
    with pytest.raises(threefold.PlanError, match="needs 2 ranks"):
        threefold.parallelize(w["model"], Plan(pp=2), w["inputs"], w["loss_fn"], target=w["target"])
