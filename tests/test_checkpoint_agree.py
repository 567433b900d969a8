"""One source of initial weights: ranks that build different weights train rank 0's model."""
import pytest
import torch

from threefold.runtime.launch import launch
from tests.parity import load_workload, max_rel_diff

GPT = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8}
STEPS = 3


def _unseeded_rank(plans):
    """Each rank builds its model from a different seed (as an unseeded factory under
    torchrun would); the batch is rank 0's."""
    import torch.distributed as dist
    import threefold
    from threefold.checkpoint.agree import batch_as_rank0
    torch.set_num_threads(1)
    rank = dist.get_rank()
    ref = load_workload("gpt", seed=10, **GPT)
    out = {}
    for plan in plans:
        mine = load_workload("gpt", seed=10 + rank, **GPT)
        pm = threefold.parallelize(mine["model"], plan, ref["inputs"], ref["loss_fn"], target=ref["target"])
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            losses.append(pm.step(*ref["inputs"], target=ref["target"]))
            opt.step()
        out[plan] = losses
    batch = batch_as_rank0((*mine["inputs"], mine["target"], 3))
    out["batch_is_rank0s"] = all(torch.equal(a, b) for a, b in zip(batch[:2], (*ref["inputs"], ref["target"])))
    out["scalar_kept"] = batch[2] == 3
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unseeded_ranks_train_rank0_weights_under_dp_and_tp():
    ref = load_workload("gpt", seed=10, **GPT)
    model = ref["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ref["loss_fn"](model(*ref["inputs"]), ref["target"])
        loss.backward()
        opt.step()
        expected.append(loss.item())
    plans = ["dp=2", "tp=2"]
    results = launch(_unseeded_rank, 2, plans, timeout=280)
    for rank, res in enumerate(results):
        for plan in plans:
            assert max_rel_diff(res[plan], expected) < 1e-5, (rank, plan, res[plan], expected)
        assert res["batch_is_rank0s"] and res["scalar_kept"]
