"""Gradient-norm parity: the global norm `pm.clip_grad_norm_` computes (and clips by) under
tp, pp and dp equals a single process's torch.nn.utils.clip_grad_norm_ at every step.

max_norm is below the norm, so clipping scales every step: the losses after clipped SGD
updates match too, which checks the scaling as well as the norm. examples/gpt.py ties the
LM head to the token embedding (a parameter on two stages under pp); vocab 95 under tp=2
pads the vocabulary (padding rows must not count); sp=true sums norm gradients over tp;
zero=1 leaves each dp rank only its rows of every gradient.
"""
import pytest

from tests.grad_norm_job import parallel, reference
from tests.parity import max_rel_diff
from threefold.runtime.launch import launch

STEPS = 4
MAX_NORM = 0.5
GPT = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8}


def _check(cases, results):
    for i, (plan, kwargs) in enumerate(cases):
        ref_losses, ref_norms = reference(kwargs, STEPS, MAX_NORM)
        assert all(n > MAX_NORM for n in ref_norms), ref_norms      # clipping is active
        for rank_result in results:
            r = rank_result[i]
            assert max_rel_diff(r["norms"], ref_norms) < 1e-5, (plan, r["norms"], ref_norms)
            assert max_rel_diff(r["losses"], ref_losses) < 1e-5, (plan, r["losses"], ref_losses)
        assert len({tuple(rr[i]["norms"]) for rr in results}) == 1, plan   # the same on every rank


def test_single_process_norm_matches_torch():
    import torch
    import threefold
    from tests.parity import load_workload
    from tests.grad_norm_job import LR, clipped_steps
    w = load_workload("gpt", **GPT)
    pm = threefold.parallelize(w["model"], "pp=1", w["inputs"], w["loss_fn"], target=w["target"])
    losses, norms = clipped_steps(w, lambda: pm.step(*w["inputs"], target=w["target"]),
                                  torch.optim.SGD(pm.parameters(), lr=LR), lambda: pm.clip_grad_norm_(MAX_NORM), STEPS)
    ref_losses, ref_norms = reference(GPT, STEPS, MAX_NORM)
    assert max_rel_diff(norms, ref_norms) < 1e-5 and max_rel_diff(losses, ref_losses) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grad_norm_parity_two_ranks():
    cases = [("tp=2", GPT), ("pp=2,m=2", GPT), ("dp=2", GPT), ("dp=2,zero=1", GPT),
             ("tp=2", {**GPT, "vocab_size": 95}), ("tp=2,sp=true", GPT)]
    results = launch(parallel, 2, cases, STEPS, MAX_NORM, timeout=380)
    _check(cases, results)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_grad_norm_parity_tp2_pp2_dp2():
    cases = [("tp=2,pp=2,dp=2,m=2", GPT)]
    results = launch(parallel, 8, cases, STEPS, MAX_NORM, timeout=480)
    _check(cases, results)
