"""A model that returns its own loss trains on it without a loss_fn, exactly as one process
would (losses and gradient norms over several SGD steps), under every plan family; a model
without any loss, or whose first loss is not finite, is a one-line PlanError."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import threefold
from threefold.model_loss import AmbiguousLoss, model_loss
from tests.own_loss_jobs import parallel, reference

STEPS = 3
RTOL = 1e-5


def _close(got, want):
    assert not isinstance(got, str), got
    for (loss, norm), (rloss, rnorm) in zip(got, want, strict=True):
        assert math.isclose(loss, rloss, rel_tol=RTOL, abs_tol=1e-6), (got, want)
        assert math.isclose(norm, rnorm, rel_tol=1e-4, abs_tol=1e-6), (got, want)


def test_the_loss_rule_finds_scalar_dot_loss_and_tuple_entries():
    s, logits = torch.tensor(1.5), torch.randn(2, 3)
    assert model_loss(s) is s
    assert model_loss({"loss": s, "logits": logits}) is s
    assert model_loss((logits, s)) is s and model_loss([s, logits]) is s
    assert model_loss(logits) is None and model_loss((logits, logits)) is None
    assert model_loss((s, torch.tensor(0.1), logits)) is s          # HF return_dict=False: loss first
    with pytest.raises(AmbiguousLoss):
        model_loss((logits, s, torch.tensor(0.1)))


class _NoLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _LogLoss(torch.nn.Module):
    """Its loss is nan from the start: log of negative pre-activations."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.log(self.inner(x))).mean()


def test_no_loss_is_a_plan_error_at_step_and_target_without_loss_fn_at_parallelize():
    model, x = _NoLoss(), torch.randn(4, 4)
    pm = threefold.parallelize(model, "m=2", (x,))
    with pytest.raises(threefold.PlanError, match="returns no loss and no loss_fn"):
        pm.step(x, target=x)
    assert pm(x).shape == (4, 4)                      # inference still works
    with pytest.raises(threefold.PlanError, match="target=... but no loss_fn"):
        threefold.parallelize(model, "m=2", (x,), target=x)


def test_a_nonfinite_first_loss_names_the_op_that_made_it():
    torch.manual_seed(0)
    model, x = _LogLoss(), torch.randn(4, 4)
    pm = threefold.parallelize(model, "m=2", (x,))
    with pytest.raises(threefold.PlanError, match=r"first non-finite value comes from aten\.log\.default"):
        pm.step(x)


def test_own_loss_single_rank_microbatches_match_one_process():
    want = reference("own_gpt", STEPS)
    got = parallel([("own_gpt", "m=2"), ("own_gpt", "m=4")], STEPS)
    for g in got:
        _close(g, want)


def test_pm_call_returns_the_models_outputs_with_the_exact_loss():
    from tests.own_loss_jobs import own_gpt
    w = own_gpt()
    pm = threefold.parallelize(w["model"], "m=2", w["inputs"])
    logits, loss = pm(*w["inputs"])
    with torch.no_grad():
        elogits, eloss = w["model"](*w["inputs"])
    assert torch.allclose(logits, elogits, atol=1e-6)
    assert math.isclose(loss.item(), eloss.item(), rel_tol=1e-6)


def _launch(cases, world=2):
    from threefold.runtime.launch import launch
    return launch(parallel, world, cases, STEPS, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_own_loss_matches_one_process_under_tp_pp_zero_cp():
    cases = [("own_gpt", p) for p in ("tp=2", "pp=2,m=2", "dp=2,zero=3", "cp=2")]
    want = reference("own_gpt", STEPS)
    for rank in _launch(cases):
        for got in rank:
            _close(got, want)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_labels_loss_matches_one_process_under_pp_tp_dp_and_ep():
    cases = [("llama", "pp=2,m=2"), ("llama", "tp=2"), ("llama", "dp=2,m=2"), ("mixtral", "dp=2,ep=2")]
    want = {"llama": reference("llama", STEPS), "mixtral": reference("mixtral", STEPS)}
    for rank in _launch(cases):
        for (name, _), got in zip(cases, rank):
            _close(got, want[name])


def test_check_and_train_accept_a_model_with_its_own_loss_and_refuse_one_without():
    from threefold.model_loss import check_trainable
    from threefold.workload import Workload
    from tests.own_loss_jobs import own_gpt
    w = own_gpt()
    check_trainable(Workload(w["model"], w["inputs"]), "SPEC 'own'")     # no loss_fn: its own loss
    with pytest.raises(threefold.PlanError, match="returns no loss"):
        check_trainable(Workload(_NoLoss(), (torch.randn(2, 4),)), "SPEC 'x'")
    with pytest.raises(threefold.PlanError, match="no target"):
        check_trainable(Workload(_NoLoss(), (torch.randn(2, 4),), None, F.mse_loss), "SPEC 'x'")
