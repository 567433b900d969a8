"""Compile-time semantics (no ranks): the loss form read from the graph, PlanErrors for what
cannot be combined exactly (BatchNorm statistics, non-separable losses), batch dims found
from the inputs or declared, and in-place writes on received values cloned first."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import threefold
from threefold.codegen.artifact import build_manifest, build_sources
from threefold.compiler.api import compile_workload
from tests import semantics_models as sm
from tests.foundation_helpers import unwrapped


def _w(model, x, y, loss_fn, **kw):
    return {"model": model, "inputs": (x,), "target": y, "loss_fn": loss_fn, **kw}


class Lin(nn.Module):
    def __init__(self, n_in=8, n_out=5):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.fc(x)


X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))


@pytest.mark.parametrize("loss_fn,kind", [
    (F.cross_entropy, "graph"),
    (lambda o, t: F.cross_entropy(o, t, reduction="sum"), "one"),
    (lambda o, t: F.cross_entropy(o, t, label_smoothing=0.1) * 0.5, "graph"),
    (lambda o, t: F.mse_loss(o, F.one_hot(t, 5).float()), "const"),
    (lambda o, t: o.pow(2).mean(), "const"),
    (lambda o, t: F.kl_div(F.log_softmax(o, -1), F.one_hot(t, 5).float(), reduction="batchmean"), "const"),
    (lambda o, t: (F.cross_entropy(o, t, reduction="none") * (t + 1)).sum() / (t + 1).sum(), "graph"),
])
def test_loss_form_is_read_from_the_graph(loss_fn, kind):
    prog = compile_workload(_w(Lin(), X, Y, loss_fn), "m=2")
    assert prog.loss_form["mode"] == "exact"
    assert prog.loss_form["denominator"]["kind"] == kind


def test_loss_form_combines_exactly_in_one_process():
    """m=4 in one process (no ranks): every loss form equals the eager global loss."""
    weight = torch.tensor([1.0, 2.0, 3.0, 0.5, 1.5])
    losses = [F.cross_entropy, lambda o, t: F.cross_entropy(o, t, reduction="sum"),
              lambda o, t: F.cross_entropy(o, t, weight=weight),      # weighted mean over valid targets
              lambda o, t: F.mse_loss(o, F.one_hot(t, 5).float()) / 3,
              lambda o, t: F.kl_div(F.log_softmax(o, -1), F.one_hot(t, 5).float(), reduction="batchmean"),
              # a weighted token mean written by hand: a row sum over a sum of target weights
              lambda o, t: (F.cross_entropy(o, t, reduction="none") * (t % 3 + 1)).sum() / (t % 3 + 1).sum()]
    y = Y.clone()
    y[:5] = -100
    for lf in losses:
        torch.manual_seed(0)
        model = Lin()
        target = y if lf in (F.cross_entropy, losses[2]) else Y
        pm = threefold.parallelize(model, "m=4", (X,), lf, target=target)
        eager = lf(model(X), target).item()
        assert abs(pm.evaluate(X, target=target) - eager) <= 1e-5 * abs(eager)


def test_non_separable_loss_is_a_plan_error_naming_the_op_and_options():
    with pytest.raises(threefold.PlanError, match=r"aten\.sqrt.*loss=microbatch_mean.*m=1"):
        compile_workload(_w(Lin(), X, Y, lambda o, t: F.mse_loss(o, F.one_hot(t, 5).float()).sqrt()), "m=2")
    with pytest.raises(threefold.PlanError, match=r"depends on parameter"):   # divisor from weights
        compile_workload(_w(Lin(), X, Y, lambda o, t: F.cross_entropy(o, t, reduction="sum") / o.abs().sum()), "m=2")
    with pytest.raises(threefold.PlanError, match=r"aten\.div"):    # a mean divided again
        compile_workload(_w(Lin(), X, Y, lambda o, t: F.cross_entropy(o, t) / (t + 1).sum()), "m=2")
    with pytest.raises(threefold.PlanError, match=r"aten\.add"):   # two terms, two denominators
        compile_workload(_w(Lin(), X, Y, lambda o, t: F.cross_entropy(o, t) + 0.1 * o.pow(2).mean()), "m=2")
    # the opt-in plan key keeps the old mean of microbatch losses; m=1 needs nothing
    prog = compile_workload(_w(Lin(), X, Y, lambda o, t: F.mse_loss(o, F.one_hot(t, 5).float()).sqrt()),
                            "m=2,loss=microbatch_mean")
    assert prog.loss_form["mode"] == "microbatch_mean"
    assert compile_workload(_w(Lin(), X, Y, lambda o, t: o.mean().sqrt()), "m=1").loss_form["mode"] == "whole"


class BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.norm = nn.BatchNorm1d(5)

    def forward(self, x):
        return self.norm(self.fc(x))


def test_batchnorm_in_training_mode_is_a_plan_error_unless_opted_in():
    with pytest.raises(threefold.PlanError, match=r"'norm'.*batch_norm.*m=1 and dp=1.*batchnorm=local"):
        compile_workload(_w(BN(), X, Y, F.cross_entropy), "m=2")
    prog = compile_workload(_w(BN(), X, Y, F.cross_entropy), "m=2,batchnorm=local")
    assert any("batchnorm=local" in n for n in prog.notes)
    compile_workload(_w(BN(), X, Y, F.cross_entropy), "m=1")          # one microbatch: exact
    compile_workload(_w(BN().eval(), X, Y, F.cross_entropy), "m=2")   # running statistics: exact


def test_batchnorm_follows_eval_mode_in_generated_code():
    src = unwrapped(build_sources(compile_workload(_w(BN(), X, Y, F.cross_entropy), "m=1"))["chunk00.py"])
    assert "self.training, 0.1" in src


def test_rrelu_follows_eval_mode_in_generated_code():
    """rrelu's training flag is its 4th argument (rrelu_with_noise's 5th): read by position as
    the 5th, it stayed True in the chunk, so pm.eval() still drew random slopes."""
    model = nn.Sequential(nn.Linear(8, 8), nn.RReLU()).train()
    w = {"model": model, "inputs": (torch.randn(4, 8),), "target": torch.randn(4, 8), "loss_fn": F.mse_loss}
    src = build_sources(compile_workload(w, "pp=1"))["chunk00.py"]
    call = src[src.index("aten.rrelu.default"):]
    assert call[:call.index(")")].rstrip().endswith("self.training")


def test_exponential_noise_is_seeded_like_every_random_op():
    """Gumbel noise, -log(exponential_()): it read the default generator (each rank and each
    replay drew its own); now seeded per op like bernoulli and uniform."""
    class Gumbel(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            return h - torch.empty_like(h).exponential_().log()
    w = {"model": Gumbel(), "inputs": (torch.randn(4, 8),), "target": torch.randn(4, 8), "loss_fn": F.mse_loss}
    src = build_sources(compile_workload(w, "pp=1"))["chunk00.py"]
    assert "random_ops.seeded(self.rng_seed(0, False), aten.exponential_.default" in src


def test_batch_dims_found_declared_or_asked_for():
    prog = compile_workload(sm.seq_first(), "m=2")
    assert prog.batch_dims == [1, 0]
    manifest = build_manifest(prog, build_sources(prog), {}, with_weights=False)
    assert manifest["batch_dims"] == [1, 0]
    # [seq, batch] tokens with a [seq, batch] target: ambiguous sizes, the numeric check
    # picks the batch (a causal split along the sequence would lack the prefix).
    w = sm.mlm()
    w["inputs"] = (w["inputs"][0].t().contiguous(),)
    w["target"] = w["target"].t().contiguous()
    model = w["model"]

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model
            self.mix = nn.Linear(6, 6)   # mixes along dim 0 (the sequence)

        def forward(self, ids):          # ids [S=6, B=4]
            h = self.inner(ids.t())      # [B, S, V]
            return self.mix(h.transpose(1, 2)).transpose(1, 2).transpose(0, 1)  # [S, B, V]

    w["model"] = SeqFirst()
    w["loss_fn"] = lambda o, t: F.cross_entropy(o.reshape(-1, sm.V), t.reshape(-1))
    assert compile_workload(w, "m=2").batch_dims == [1, 1]
    w["batch_dims"] = (1, 1)
    assert compile_workload(w, "m=2").batch_dims == [1, 1]
    w["batch_dims"] = (0, 5)
    with pytest.raises(threefold.PlanError, match=r"batch_dims\[1\]=5"):
        compile_workload(w, "m=2")


def test_a_sequence_dim_that_alone_divides_dp_m_is_not_taken_for_the_batch():
    # batch 2, seq 16, m=4: only the sequence divides; a causal LM must not be split there
    # (it trained wrong losses silently: each piece lacked its prefix)
    from tests.parity import load_workload
    w = load_workload("gpt", n_layer=1, n_embd=16, n_head=2, seq=16, batch=2)
    with pytest.raises(threefold.PlanError, match=r"no batch dimension.*dp\*m=4.*do not split the model's rows"):
        compile_workload(w, "m=4")
    assert compile_workload(w, "m=2").batch_dims == [0, 0]


def test_ambiguous_batch_dim_on_meta_is_dim_zero_with_a_note():
    with torch.device("meta"):
        model = Lin(4, 4)
    prog = compile_workload({"model": model, "inputs": (torch.randn(4, 4, device="meta"),)}, "m=2")
    assert prog.batch_dims == [0] and any("batch dim ambiguous" in n for n in prog.notes)


def test_received_tensor_written_in_place_is_cloned_first():
    prog = compile_workload(sm.mlm(split=True), "pp=2,m=2")
    src = build_sources(prog)["chunk01.py"]
    body = src.split("def forward")[1]
    clone = body.index(".clone()  # written in place below")
    assert clone < body.index("aten.add_.Tensor")


def test_forward_concatenates_microbatch_outputs_along_their_batch_dim():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    x = torch.randn(6, 4, 16)                                 # [seq, batch, hidden]
    pm = threefold.parallelize(model, "m=2", (x,))
    assert pm.manifest["batch_dims"] == [1] and pm.manifest["output_batch_dims"] == [1]
    with torch.no_grad():
        eager = model(x)
    out = pm(x)
    assert out.shape == eager.shape and torch.allclose(out, eager, atol=1e-5)
