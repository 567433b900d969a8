"""An expert capacity queue under cp (passes/cp_counts.py): a cumsum over every token of the
batch (the batch and sequence flattened) runs on the gathered tokens, and the capacity the
model computes from its token count (a constant of the trace: the local count under cp) is
read from the model traced at the whole length, as one process computes it."""
import pytest
import torch

from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_factory_models import grad_diff, reference, zoo_grads_parity
from tests.cp_jobs import zoo_batch2
from tests.parity import max_rel_diff


def _capacities(prog) -> set:
    """The numbers the compiled code compares the queue positions with."""
    import re
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    return set(re.findall(r"aten\.lt\.Scalar\([^,]+, (\d+)\)", code))


def test_the_capacity_is_one_process_number_not_this_rank_one():
    """2 rows x 8 tokens, factor 0.5, k=2, 4 experts: capacity ceil(0.5 * 16 * 2 / 4) = 4 in one
    process; cp=2 traces 2 x 4 tokens (capacity 2), so without the twin's number it is 2."""
    from tests.zoo.handwritten_coupling import CapacityMoE
    w = zoo_batch2("hw_moe_capacity")
    assert isinstance(w["model"], CapacityMoE)
    prog = compile_workload(w, "cp=2")
    assert _capacities(prog) == {"4"}, _capacities(prog)
    notes = [n for n in prog.notes if n.startswith("cp fallback:")]
    assert len(notes) == 1 and notes[0].startswith("cp fallback: cumsum ("), notes


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_capacity_moe_at_cp_matches_one_process_losses_and_grads(cp):
    torch.set_num_threads(1)
    got = launch(zoo_grads_parity, cp, ["hw_moe_capacity"], f"cp={cp}", 3, timeout=550)
    ref_losses, ref_grads = reference(zoo_batch2("hw_moe_capacity"))
    for rank in got:
        losses, grads = rank["hw_moe_capacity"]
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-4, grad_diff(grads, ref_grads)


def grouped_capacity() -> dict:
    """The grouped-matmul capacity MoE (tests/zoo/handwritten_moe.CapacityMoELM: the queue's
    cumsum, a routing argsort of the kept picks, expert matmuls over sorted rows) trained on its
    LM loss alone (its aux loss, a product of two means over the batch, is no sum over rows)."""
    from tests.zoo.common import lm_loss, token_batch, workload
    from tests.zoo.handwritten_moe import CapacityMoELM
    torch.manual_seed(0)
    inputs, target = token_batch(seed=0)
    w = workload(CapacityMoELM().train(), (inputs,), target, lambda out, t: lm_loss(out[0], t))
    return {**w, "batch_dims": (0, 0)}


def grouped_parity(plan: str, steps: int = 3):
    from tests.cp_factory_models import parallel
    torch.set_num_threads(1)
    return parallel(grouped_capacity(), plan, steps)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grouped_capacity_moe_at_cp2_matches_one_process_losses_and_grads():
    from tests.zoo.handwritten_moe import dropped_picks
    w = grouped_capacity()
    assert dropped_picks(w["model"], w["inputs"][0]) > 0   # the capacity drops picks: the test can fail
    got = launch(grouped_parity, 2, "cp=2", 3, timeout=550)
    ref_losses, ref_grads = reference(grouped_capacity())
    for losses, grads in got:
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-4, grad_diff(grads, ref_grads)


def _graph(count: int, n: int, name: str = "lt") -> "torch.fx.Graph":
    """x [n] -> lt(x, count), as export writes it (its stack trace in meta)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta = {"val": torch.zeros(n), "stack_trace": "model"}
    lt = g.call_function(torch.ops.aten.lt.Scalar, (x, count))
    lt.name = name
    lt.meta = {"val": torch.zeros(n, dtype=torch.bool), "stack_trace": "model"}
    g.output(lt)
    return g


def _stage(whole):
    from types import SimpleNamespace
    return SimpleNamespace(retrace=lambda s: whole, seq_len=4, plan=SimpleNamespace(cp=2))


def test_an_elementwise_op_on_counts_takes_its_twin_number_or_is_refused_in_one_line():
    import threefold
    from threefold.passes.cp_counts import whole_scalars
    local = _graph(2, 8)
    lt = next(n for n in local.nodes if n.name == "lt")
    whole_scalars(lt, _stage(_graph(4, 16)), "cp=2: lt at <top> reads a count over the whole batch")
    assert lt.args[1] == 4
    for other in (_graph(4, 16, "gt"), _graph(4, 12)):   # no op of its name; not the whole shapes
        lt = next(n for n in _graph(2, 8).nodes if n.name == "lt")
        with pytest.raises(threefold.PlanError, match="cp=2: lt at <top> reads a count") as err:
            whole_scalars(lt, _stage(other), "cp=2: lt at <top> reads a count over the whole batch")
        assert "\n" not in str(err.value)
