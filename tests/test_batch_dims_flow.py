"""The batch dimension when sizes coincide (batch == seq, batch == heads): the inputs' dim
is the one whose slices give slices of the outputs, and the target's the one whose parts
meet their own rows at the loss (issue 40 item 5). A [T, B] target with B == T was cut
along T before, pairing each part's outputs with other rows' labels: silently wrong."""
from __future__ import annotations

import pytest
import torch

from tests import batch_dims_models as bm
from tests.parity import max_rel_diff, sgd_losses
from threefold.passes.batch_dims import find_batch_dims
from threefold.runtime.launch import launch

STEPS = 3


def _dims(name: str) -> list:
    w = bm.FACTORIES[name]()
    return find_batch_dims(w["model"], tuple(w["inputs"]) + (w["target"],), len(w["inputs"]), parts=2,
                           name=name, loss_fn=w["loss_fn"])


def test_a_seq_first_target_with_batch_equal_to_seq_is_cut_along_its_batch():
    assert _dims("seq_first_b8_t8") == [1, 1]


@pytest.mark.parametrize("name", ["nanogpt_b8_t8", "nanogpt_b4_h4"])
def test_batch_first_models_keep_dim_0_when_seq_or_heads_equal_the_batch(name):
    assert _dims(name) == [0, 0]


def test_the_wrong_target_split_changes_the_loss():
    """Why it matters: the two pairings give different part losses (the check can fail)."""
    w = bm.seq_first_batch_eq_seq()
    x, y = w["inputs"][0], w["target"]
    with torch.no_grad():
        out = w["model"](x[:, 4:])
        right, wrong = float(w["loss_fn"](out, y[:, 4:])), float(w["loss_fn"](out, y[4:, :]))
    assert abs(right - wrong) > 1e-3 * abs(right)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_coinciding_sizes_train_like_one_process_under_dp_and_pp():
    cases = [(n, p) for n in bm.FACTORIES for p in ("dp=2", "pp=2,m=2")]
    refs = {n: sgd_losses(bm.FACTORIES[n](), STEPS) for n in bm.FACTORIES}
    ranks = launch(bm.run, 2, cases, STEPS, timeout=550)
    for rank in ranks:
        for (name, plan), r in zip(cases, rank):
            assert max_rel_diff(r["losses"], refs[name]) < 1e-5, (name, plan, r["losses"], refs[name])
            assert r["batch_dims"] == ([1, 1] if name.startswith("seq_first") else [0, 0]), (name, plan, r)
