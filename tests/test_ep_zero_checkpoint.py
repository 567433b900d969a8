"""Checkpoints of ep with ZeRO: an expert's optimizer state (and under zero=3 the
parameter itself) on a rank is rows of its ep rows, written as one rectangle of the full
tensor (checkpoint/zero_state.rows_within), so any plan loads it.

Four ranks, the hand-written top-2 MoE, AdamW: 2 steps, save, load under another plan, 2
more steps; the losses of steps 3 and 4 (step 4 reads AdamW's moments) equal one process's.
  dp=4,ep=2,zero=1 -> dp=4 (no ep, no ZeRO) -> dp=4,ep=2,zero=1 (each loads the one before)
  dp=4,ep=2,zero=3 -> dp=4,ep=2,zero=2 -> dp=4,ep=4,zero=1
"""
import pytest
import torch

import threefold
from tests.parity import adamw_losses, max_rel_diff

LR = 1e-2
CHAINS = [["dp=4,ep=2,zero=1", "dp=4", "dp=4,ep=2,zero=1"],
          ["dp=4,ep=2,zero=3", "dp=4,ep=2,zero=2", "dp=4,ep=4,zero=1"]]


def _rank(directory: str, chains: list[list[str]]) -> list[dict]:
    """Each chain: the first plan trains 2 steps and saves; every later plan loads the
    previous save, trains steps 3 and 4, and saves its own state after step 2's load (so
    the next plan starts from the same point)."""
    from tests.zoo import ZOO
    torch.set_num_threads(1)
    out = []
    for k, chain in enumerate(chains):
        for i, plan in enumerate(chain):
            torch.manual_seed(1234)
            w = ZOO["hw_moe_top2"]()
            pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
            opt = pm.optimizer(torch.optim.AdamW, lr=LR)
            path = f"{directory}/c{k}p{i}"
            if i == 0:
                for _ in range(2):
                    opt.zero_grad()
                    pm.step(*w["inputs"], target=w["target"])
                    opt.step()
            else:
                threefold.load(pm, opt, f"{directory}/c{k}p{i - 1}")
            threefold.save(pm, opt, path, step=2)   # what this plan holds after step 2
            if i == 0:
                continue
            losses = []
            for _ in range(2):   # step 3 (the weights) and step 4 (AdamW's moments too)
                opt.zero_grad()
                losses.append(pm.step(*w["inputs"], target=w["target"]))
                opt.step()
            out.append({"plan": plan, "from": chain[i - 1], "losses": losses})
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep_zero_checkpoints_load_under_other_plans_and_continue_like_one_process(tmp_path):
    from tests.zoo import ZOO
    torch.manual_seed(1234)
    ref = adamw_losses(ZOO["hw_moe_top2"](), 4, LR)
    for per_rank in threefold.launch(_rank, 4, str(tmp_path), CHAINS, timeout=550):
        assert len(per_rank) == 4
        for r in per_rank:
            assert max_rel_diff(r["losses"], ref[2:]) < 1e-5, (r, ref)
