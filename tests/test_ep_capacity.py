"""Token dropping under ep: a top-2 MoE with expert capacity (GShard / Switch: a pick's
place in its expert's queue is a cumsum over the layer's tokens; picks past capacity are
sorted past the last expert's rows, not computed, and weighted 0; tests/zoo/handwritten_moe.py).

The queue runs over every token the layer sees, so which picks are dropped depends on the
whole batch: a split batch cannot reproduce it, and the batch-coupling pass refuses dp > 1
unless `loss=microbatch_mean`, under which each dp rank queues its own tokens (Megatron's
and DeepSpeed's behaviour). ep must then compute exactly that: dp=2,ep=2 equals one process
taking the mean of the two half-batches' losses, with and without the router's
load-balancing loss (3 SGD steps, fp32, rtol 1e-5). Dropped rows stay on their rank
(runtime/experts.py `_past_last_expert`)."""
import pytest
import torch

import threefold
from tests.parity import max_rel_diff

STEPS = 3


def test_capacity_under_ep_without_microbatch_mean_is_a_one_line_plan_error():
    from tests.zoo.handwritten_moe import capacity_moe
    from threefold.compiler.api import compile_workload
    w = capacity_moe()
    with pytest.raises(threefold.PlanError) as info:
        compile_workload(w, "dp=2,ep=2")
    msg = str(info.value)
    assert "\n" not in msg and "loss=microbatch_mean" in msg, msg


def _parts_reference(aux: float, parts: int) -> list[float]:
    """One process: each step's loss is the mean of the `parts` batch slices' losses."""
    from tests.zoo.handwritten_moe import capacity_moe
    w = capacity_moe(aux_coef=aux)
    model, (x,), t = w["model"], w["inputs"], w["target"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = x.shape[0] // parts
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(w["loss_fn"](model(x[i:i + n]), t[i:i + n]) for i in range(0, x.shape[0], n)) / parts
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _rank(plan: str, aux: float) -> list[float]:
    from tests.parity import parallel_sgd_losses
    from tests.zoo.handwritten_moe import capacity_moe
    torch.set_num_threads(1)
    w = capacity_moe(aux_coef=aux)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"],
                               batch_dims=w["batch_dims"])
    return parallel_sgd_losses(pm, w, STEPS)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("aux", [0.0, 1.0])
def test_capacity_with_microbatch_mean_under_ep2_equals_the_halves_of_one_process(aux):
    from tests.zoo.handwritten_moe import capacity_moe, dropped_picks
    ref = _parts_reference(aux, 2)
    w = capacity_moe(aux_coef=aux)
    x = w["inputs"][0]
    assert dropped_picks(w["model"], x[:2]) > 0 and dropped_picks(w["model"], x[2:]) > 0
    with torch.no_grad():      # the split matters: the whole batch drops other picks
        whole = float(w["loss_fn"](w["model"](*w["inputs"]), w["target"]))
    assert abs(whole - ref[0]) / ref[0] > 1e-5, (whole, ref[0])
    a, b = threefold.launch(_rank, 2, "dp=2,ep=2,loss=microbatch_mean", aux, timeout=360)
    assert a == b
    assert max_rel_diff(a, ref) < 1e-5, (a, ref)
