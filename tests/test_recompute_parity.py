"""Parity: recompute=full and selective train exactly like recompute=none and one process
(3 SGD steps, fp32, rtol 1e-5) under pp=2 and tp=2, on examples/gpt.py and HF LLaMA."""
import pytest

from threefold.runtime.launch import launch
from tests.parity import max_rel_diff, parallel_losses, reference_losses
from tests.test_recompute import GPT_KW, LLAMA_KW, _compile

STEPS = 3
PLANS = [f"{base}{mode}" for base in ("pp=2,m=2", "tp=2")
         for mode in ("", ",recompute=full", ",recompute=selective")]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("factory,kwargs", [("gpt", GPT_KW), ("llama", LLAMA_KW)])
def test_recompute_matches_none_and_single_process(factory, kwargs):
    for plan in ("pp=2,m=2,recompute=selective", "tp=2,recompute=selective"):  # something is recomputed
        assert all(c.recompute for c in _compile(factory, kwargs, plan).chunks), plan
    ref = reference_losses(factory, kwargs, STEPS)
    results = launch(parallel_losses, 2, PLANS, factory, kwargs, STEPS, timeout=550)
    for rank_result in results:
        by_plan = {r["plan"]: r["losses"] for r in rank_result}
        for plan, losses in by_plan.items():
            assert max_rel_diff(losses, ref) < 1e-5, (plan, losses, ref)
            base = plan.split(",recompute=")[0]
            assert max_rel_diff(losses, by_plan[base]) < 1e-5, (plan, losses, by_plan[base])


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_recompute_under_sequence_parallel_and_interleaving():
    """Recomputed segments hold sp's all-gathers/reduce-scatters; interleaving reruns chunks
    out of order (the rerun's dropout key and collectives must still line up)."""
    kwargs = dict(GPT_KW, n_layer=4)
    plans = [f"{base},recompute={mode}" for base in ("tp=2,sp=true", "pp=2,m=4,v=2,schedule=interleaved")
             for mode in ("full", "selective")]
    ref = reference_losses("gpt", kwargs, STEPS)
    for rank_result in launch(parallel_losses, 2, plans, "gpt", kwargs, STEPS, timeout=450):
        for r in rank_result:
            assert max_rel_diff(r["losses"], ref) < 1e-5, (r["plan"], r["losses"], ref)
