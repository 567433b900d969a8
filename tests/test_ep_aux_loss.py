"""Router load-balancing loss under ep (Mixtral, output_router_logits=True).

aux = E x sum_e f_e x P_e, with f_e and P_e means over every token of the batch: a product
of two batch means, which no split of the batch over dp ranks or microbatches reproduces.
ep=N always splits the batch (ep divides dp), so the exact loss is a one-line PlanError
naming the option; with loss=microbatch_mean each rank balances its own tokens, and ep
must compute exactly that: the mean of the two halves' losses of one process (coef 1.0,
so the aux term is large enough that the split visibly changes the loss)."""
import pytest
import torch

import threefold
from tests.parity import max_rel_diff

STEPS = 3


def test_aux_loss_under_ep_is_a_one_line_plan_error_naming_microbatch_mean():
    from tests.zoo.moe_aux import mixtral_aux
    from threefold.compiler.api import compile_workload
    with pytest.raises(threefold.PlanError) as info:
        compile_workload(mixtral_aux(coef=1.0), "dp=2,ep=2")
    msg = str(info.value)
    assert "\n" not in msg and "ep=2 always splits the batch" in msg and "loss=microbatch_mean" in msg


def _halves_reference() -> list[float]:
    """One process: each step's loss is the mean of the two half-batches' losses."""
    from tests.zoo.moe_aux import mixtral_aux
    torch.manual_seed(1234)
    w = mixtral_aux(coef=1.0)
    model, (x,), t = w["model"], w["inputs"], w["target"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(w["loss_fn"](model(x[i:i + 2]), t[i:i + 2]) for i in (0, 2)) / 2
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _rank() -> list[float]:
    from tests.parity import parallel_sgd_losses
    from tests.zoo.moe_aux import mixtral_aux
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    w = mixtral_aux(coef=1.0)
    pm = threefold.parallelize(w["model"], "dp=2,ep=2,loss=microbatch_mean", w["inputs"], w["loss_fn"],
                               target=w["target"], batch_dims=w["batch_dims"])
    return parallel_sgd_losses(pm, w, STEPS)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_aux_loss_with_microbatch_mean_under_ep2_equals_the_halves_of_one_process():
    ref = _halves_reference()
    from tests.zoo.moe_aux import mixtral_aux
    torch.manual_seed(1234)
    w = mixtral_aux(coef=1.0)
    with torch.no_grad():      # the split matters: the whole batch's loss is another number
        whole = float(w["loss_fn"](w["model"](*w["inputs"]), w["target"]))
    assert abs(whole - ref[0]) / ref[0] > 1e-5, (whole, ref[0])
    a, b = threefold.launch(_rank, 2, timeout=360)
    assert a == b
    assert max_rel_diff(a, ref) < 1e-5, (a, ref)
