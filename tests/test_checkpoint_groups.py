"""threefold.load into a freshly built optimizer: the train loop's two groups (decayed, not)
load into the same groups in any order (hyperparameters by the parameters they hold) and
into a fresh one-group `pm.optimizer(torch.optim.AdamW)` (state loaded, its own
hyperparameters kept); groups cut otherwise are one line."""
import pytest
import torch

import threefold
from threefold import PlanError
from threefold.train.optim import adamw, decay_split, param_roles
from tests.parity import load_workload

KW = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 4}


def _build():
    w = load_workload("gpt", **KW)
    return threefold.parallelize(w["model"], "tp=1", w["inputs"], w["loss_fn"], target=w["target"]), w


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    pm, w = _build()
    opt = adamw(pm, lr=3e-3, weight_decay=0.1)                  # what threefold train builds
    for _ in range(2):
        opt.zero_grad()
        pm.step(*w["inputs"], target=w["target"])
        opt.step()
    threefold.save(pm, opt, root, step=2)
    name = "h.0.attn.c_attn.weight"
    fresh, _ = _build()        # loaded into by each test, each with a freshly built optimizer
    return root, opt.state[pm.engine.params[name]]["exp_avg"].clone(), name, fresh


def test_a_fresh_one_group_adamw_loads_the_state_and_keeps_its_hyperparameters(saved):
    root, exp_avg, name, pm = saved
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)              # was: "2 parameter groups, this one has 1"
    with pytest.warns(UserWarning, match="keeps its own hyperparameters"):
        info = threefold.load(pm, opt, root)
    assert info["optimizer_groups"] == "kept" and opt.param_groups[0]["lr"] == 1e-4
    assert torch.equal(opt.state[pm.engine.params[name]]["exp_avg"], exp_avg)
    assert float(opt.state[pm.engine.params[name]]["step"]) == 2.0


def test_the_same_groups_in_another_order_get_their_own_hyperparameters(saved):
    root, exp_avg, name, pm = saved
    decayed, kept = decay_split(pm.named_parameters(), param_roles(pm))
    opt = torch.optim.AdamW([{"params": kept, "weight_decay": 0.5}, {"params": decayed, "weight_decay": 0.5}], lr=1)
    assert threefold.load(pm, opt, root)["optimizer_groups"] == "restored"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]    # by the parameters, not the position
    assert all(g["lr"] == 3e-3 for g in opt.param_groups)
    assert torch.equal(opt.state[pm.engine.params[name]]["exp_avg"], exp_avg)


def test_a_loaded_optimizer_keeps_how_it_runs_its_step(saved):
    root, exp_avg, name, pm = saved     # saved by a fused AdamW (threefold train's)
    decayed, kept = decay_split(pm.named_parameters(), param_roles(pm))
    opt = torch.optim.AdamW([{"params": decayed}, {"params": kept}], lr=1, fused=False, foreach=True)
    assert threefold.load(pm, opt, root)["optimizer_groups"] == "restored"
    assert all(g["lr"] == 3e-3 for g in opt.param_groups)                # hyperparameters: the checkpoint's
    assert all(g["fused"] is False and g["foreach"] is True for g in opt.param_groups)   # how it runs: its own
    assert torch.equal(opt.state[pm.engine.params[name]]["exp_avg"], exp_avg)


def test_groups_that_mix_the_saved_ones_are_one_line(saved):
    root, _, _, pm = saved
    decayed, kept = decay_split(pm.named_parameters(), param_roles(pm))
    opt = torch.optim.AdamW([{"params": decayed[:1] + kept}, {"params": decayed[1:]}], lr=1)
    with pytest.raises(PlanError, match="parameter group 0 holds .* \\(saved in group 0\\) and .* "
                                        "\\(saved in group 1\\)") as info:
        threefold.load(pm, opt, root)
    assert "\n" not in str(info.value)
