"""Ops that mix the rows of the batch (issue 21): a PlanError naming the op when m*dp > 1,
buffers written in forward (once per step, or a PlanError), custom autograd Functions whose
backward torch.export would drop (a PlanError). Compile-only except the one parity run."""
import pytest
import torch

import threefold
from threefold.compiler.api import compile_workload
from tests.zoo.handwritten_coupling import FACTORIES


@pytest.mark.parametrize("plan", ["m=2", "dp=2"])
def test_moe_capacity_cumsum_over_tokens_is_named(plan):
    # the queue position of a token in its expert is a cumsum over every token of the
    # batch: a microbatch's tokens would queue only behind its own. No candidate batch dim
    # gives slices of the full output here, so this also checks that the error names the
    # op instead of asking for batch_dims
    with pytest.raises(threefold.PlanError, match=r"aten\.cumsum in module .*mixes the rows.*m=1 and dp=1"):
        compile_workload(FACTORIES["hw_moe_capacity"](), plan)
    compile_workload(FACTORIES["hw_moe_capacity"](), "m=1")


def test_contrastive_loss_over_in_batch_pairs_is_named():
    with pytest.raises(threefold.PlanError, match=r"aten\.matmul.*every row with every other row"):
        compile_workload(FACTORIES["hw_infonce"](), "m=2")
    prog = compile_workload(FACTORIES["hw_infonce"](), "m=2,loss=microbatch_mean")   # the opt-in
    assert any("loss=microbatch_mean: aten.matmul" in n for n in prog.notes)


def test_buffer_written_from_the_batch_is_a_plan_error_a_counter_is_once_per_step():
    with pytest.raises(threefold.PlanError, match=r"buffer 'running' is written in forward from the batch"):
        compile_workload(FACTORIES["hw_running_buffer"](), "m=2")
    prog = compile_workload(FACTORIES["hw_running_buffer"](), "m=2,loss=microbatch_mean")
    assert any("buffer 'running' is updated from each microbatch" in n for n in prog.notes)
    prog = compile_workload(FACTORIES["hw_step_counter"](), "pp=2,m=2")
    assert any("once per step: step" in n for n in prog.notes)
    marked = [n for c in prog.chunks for n in c.gm.graph.nodes
              if n.op == "placeholder" and n.meta.get("tf", {}).get("once_per_step")]
    assert marked
    from threefold.codegen.python import generate_module
    assert "self.step_start('step', p_step)" in generate_module(prog, prog.chunks[0])


def test_mixing_after_the_loss_reduction_and_per_row_ops_are_not_refused():
    import torch.nn.functional as F
    w = FACTORIES["hw_step_counter"]()
    # x[arange(B), idx] picks each row's own entry: per row
    w["loss_fn"] = lambda o, t: -F.log_softmax(o, -1)[torch.arange(o.shape[0]), 0, t[:, 0]].mean()
    compile_workload(w, "m=2")


def test_custom_autograd_function_with_its_own_backward_is_named():
    with pytest.raises(threefold.PlanError, match=r"autograd\.Function RoundSTE .*'blocks\.0'.*detach"):
        compile_workload(FACTORIES["hw_ste"](), "m=1")


def test_custom_function_whose_backward_is_the_derivative_compiles():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return Square.apply(self.fc(x))
    w = {"model": M(), "inputs": (torch.randn(4, 4),), "target": torch.randn(4, 3),
         "loss_fn": torch.nn.functional.mse_loss}
    compile_workload(w, "m=2")


def _counter_run(plans):
    from tests.zoo.matrix import run_matrix
    return run_matrix(["hw_step_counter"], plans, log=lambda s: None)["cells"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_step_counter_is_exact_under_pp_and_dp():
    cells = _counter_run(["pp=2,m=2", "dp=2,m=2"])
    for plan in ("pp=2,m=2", "dp=2,m=2"):
        assert cells[("hw_step_counter", plan)]["verdict"] == "pass", cells[("hw_step_counter", plan)]


class _Rowwise(torch.nn.Module):
    """fc(f(x)) for a row pattern f given as a function."""

    def __init__(self, f):
        super().__init__()
        self.fc, self.f = torch.nn.Linear(8, 5), f

    def forward(self, x):
        return self.fc(self.f(x))


@pytest.mark.parametrize("f,mixes", [
    (lambda x: x - x.mean(0), "aten.mean"),                                    # batch centering
    # a boolean-mask index has a data-dependent size: refused first for that, under any plan
    (lambda x: x[x.sum(-1) > 0].mean(0, keepdim=True).expand(x.shape[0], -1), "size depends on the data"),
    (lambda x: x * x[0], "aten.select"),                                       # row 0 of each part
    (lambda x: torch.cumsum(x, 0), "aten.cumsum"),
    (lambda x: x.softmax(-1) * x.norm(dim=-1, keepdim=True), None),            # per row
    (lambda x: x[torch.arange(x.shape[0]), :] + x.flip(-1), None),             # each row's own
])
def test_row_patterns(f, mixes):
    import torch.nn.functional as F
    w = {"model": _Rowwise(f), "inputs": (torch.randn(4, 8),), "target": torch.randint(0, 5, (4,)),
         "loss_fn": F.cross_entropy, "batch_dims": 0}
    if mixes is None:
        compile_workload(w, "m=2")
    else:
        pattern = mixes if " " in mixes else rf"{mixes}\b.*mixes the rows"
        with pytest.raises(threefold.PlanError, match=pattern):
            compile_workload(w, "m=2")
