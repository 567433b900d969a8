"""ep with zero=1: AdamW's state of every parameter is split by rows over the dp_shard
ranks, which under ep are the edp ranks (those holding the same experts): dense
gradients are reduce-scattered over dp_shard and summed over the ep ranks, expert
gradients only reduce-scattered (runtime/zero.py). At dp=4,ep=2,zero=1 (dp_shard=2) the
hand-written top-2 MoE trains like one process, and a rank's AdamW state holds half of
its local expert rows (a quarter of each expert weight). Checkpoints of this plan:
tests/test_ep_zero_checkpoint.py."""
import pytest
import torch

import threefold
from tests.parity import adamw_losses, max_rel_diff

STEPS = 3


def _rank() -> dict:
    from tests.zoo import ZOO
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    w = ZOO["hw_moe_top2"]()
    full = {n: p.shape[0] for n, p in w["model"].named_parameters()}
    pm = threefold.parallelize(w["model"], "dp=4,ep=2,zero=1", w["inputs"], w["loss_fn"], target=w["target"])
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pm.step(*w["inputs"], target=w["target"]))
        norms.append(pm.clip_grad_norm_(1e9))
        opt.step()
    experts = pm.manifest["experts"]
    state_rows = {s.fqn: s.count for s in opt.row_shards().values() if s.fqn in experts}
    return {"losses": losses, "norm": norms[0], "state_rows": state_rows, "full": {f: full[f] for f in state_rows}}


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_ep2_zero1_trains_like_one_process_with_expert_state_over_edp():
    from tests.zoo import ZOO
    torch.manual_seed(1234)
    w = ZOO["hw_moe_top2"]()
    w["loss_fn"](w["model"](*w["inputs"]), w["target"]).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(w["model"].parameters(), 1e9))
    torch.manual_seed(1234)
    ref = adamw_losses(ZOO["hw_moe_top2"](), STEPS, 1e-2)
    ranks = threefold.launch(_rank, 4, timeout=450)
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]
        assert max_rel_diff(r["losses"], ref) < 1e-5, (r["losses"], ref)
        assert abs(r["norm"] - norm) / norm < 1e-5, (r["norm"], norm)
        # E/ep experts per rank, their rows split over the 2 edp ranks: 1/4 of each weight
        assert r["state_rows"] and all(n * 4 == r["full"][f] for f, n in r["state_rows"].items()), r
