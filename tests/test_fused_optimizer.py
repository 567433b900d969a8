"""compile=inductor's optimizer step (runtime/fused_optimizer.py): torch's fused kernel where
the class offers it, the user's own fused=/foreach= kept, a refusal a note and the unfused step."""
import pytest
import torch

import threefold
from threefold.runtime import fused_optimizer
from tests.parity import adamw_losses, load_workload, max_rel_diff

GPT = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8}


def test_fused_only_under_compile_and_only_where_the_class_offers_it_and_the_user_did_not_choose():
    assert fused_optimizer.fused_kwargs(torch.optim.AdamW, "inductor", {"lr": 1e-3}) == {"lr": 1e-3, "fused": True}
    assert fused_optimizer.fused_kwargs(torch.optim.SGD, "inductor", {}) == {"fused": True}
    assert fused_optimizer.fused_kwargs(torch.optim.AdamW, "none", {"lr": 1e-3}) == {"lr": 1e-3}
    assert fused_optimizer.fused_kwargs(torch.optim.AdamW, "inductor", {"foreach": True}) == {"foreach": True}
    assert fused_optimizer.fused_kwargs(torch.optim.AdamW, "inductor", {"fused": False}) == {"fused": False}
    assert fused_optimizer.fused_kwargs(torch.optim.RMSprop, "inductor", {}) == {}   # no fused argument


def test_an_optimizer_that_refuses_fused_is_built_unfused_with_a_one_line_note(capsys):
    class NoFusedHere(torch.optim.AdamW):
        def __init__(self, params, lr=1e-3, fused=None):
            if fused:
                raise RuntimeError("`fused=True` requires all the params to be floating point Tensors\nmore")
            super().__init__(params, lr=lr)
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = fused_optimizer.build(lambda **kw: NoFusedHere(params, **kw), NoFusedHere, {"lr": 0.1}, "inductor")
    assert isinstance(opt, NoFusedHere) and not opt.defaults["fused"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["threefold: compile=inductor: NoFusedHere runs unfused "
                   "(`fused=True` requires all the params to be floating point Tensors)"]


def test_compile_inductor_adamw_is_fused_and_matches_one_process(monkeypatch):
    """pm.optimizer(AdamW) under compile=inductor is torch's fused AdamW and its losses are
    one process's foreach AdamW (Inductor's code generation stubbed out: the chunks run the
    captured graphs eagerly, as in test_compiled_backend's fallback test; this is about the
    optimizer step)."""
    import torch._inductor.compile_fx as compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, example_inputs, **kw: gm.forward)
    torch._dynamo.reset()
    ref = adamw_losses(load_workload("gpt", **GPT), 4, 1e-2)
    w = load_workload("gpt", **GPT)
    pm = threefold.parallelize(w["model"], "compile=inductor", w["inputs"], w["loss_fn"], target=w["target"])
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    assert opt.defaults["fused"] is True
    got = []
    for _ in range(4):
        opt.zero_grad()
        got.append(pm.step(*w["inputs"], target=w["target"]))
        opt.step()
    torch._dynamo.reset()
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)
    w = load_workload("gpt", **GPT)   # compile=none: the optimizer exactly as asked
    pm = threefold.parallelize(w["model"], "m=1", w["inputs"], w["loss_fn"], target=w["target"])
    assert not pm.optimizer(torch.optim.AdamW, lr=1e-2).defaults["fused"]
