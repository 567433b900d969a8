"""The compile-time B/W backward split (codegen/backward_split.py, runtime/weight_grad.py)."""
from __future__ import annotations

import dataclasses
import re

import torch

import threefold
from threefold.codegen.python import generate_module
from threefold.compiler.api import compile_workload
from threefold.plan import Plan
from threefold.runtime.schedule import Kind, make_schedule
from threefold.runtime.weight_grad import deferred, run_deferred
from threefold.workload import Workload
from tests.parity import load_workload, max_rel_diff, parallel_sgd_losses, sgd_losses

aten = torch.ops.aten
TINY = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq": 8, "batch": 4}


class _Holder:
    weight_stash = None


def test_b_computes_input_grads_only_and_w_the_rest():
    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 5))
    b = torch.nn.Parameter(torch.randn(4))
    ref_x, ref_w, ref_b = torch.autograd.grad(torch.nn.functional.linear(x, w, b).square().sum(), (x, w, b))
    holder = _Holder()
    holder.weight_stash = []
    y = deferred(holder, aten.linear.default, (x, w, b), weights=(1, 2), params=(w, b))
    y.square().sum().backward()                     # B
    assert torch.allclose(x.grad, ref_x) and w.grad is None and b.grad is None
    assert len(holder.weight_stash) == 1            # what W needs: the op's local graph + grad
    run_deferred(holder.weight_stash)                # W
    assert torch.allclose(w.grad, ref_w) and torch.allclose(b.grad, ref_b) and not holder.weight_stash


def test_ops_without_activation_gradients_still_reach_w():
    """An embedding's token ids need no gradient; B must still reach the op to hand W its grad."""
    w = torch.nn.Parameter(torch.randn(10, 3))
    ids = torch.tensor([1, 2, 2, 7])
    holder = _Holder()
    holder.weight_stash = []
    out = deferred(holder, aten.embedding.default, (w, ids), weights=(0,), params=(w,))
    out.sum().backward()
    assert w.grad is None and len(holder.weight_stash) == 1
    run_deferred(holder.weight_stash)
    expected = torch.zeros(10, 3)
    expected.index_add_(0, ids, torch.ones(4, 3))
    assert torch.equal(w.grad, expected)


def test_without_a_stash_the_op_runs_fused():
    w = torch.nn.Parameter(torch.randn(4, 5))
    x = torch.randn(2, 5)
    deferred(_Holder(), aten.linear.default, (x, w), weights=(1,), params=(w,)).sum().backward()
    assert w.grad is not None


def _sources(schedule: str) -> str:
    w = load_workload("gpt", **TINY)
    prog = compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]),
                            Plan.parse(f"m=1,schedule={schedule}"))
    return generate_module(prog, prog.chunks[0]), prog


def test_generated_code_defers_every_parameter_read_by_an_op():
    text, prog = _sources("zb-h1")
    calls = re.findall(r"weight_grad\.deferred\((?:  #[^\n]*)?\s*self, (aten\.\w+\.\w+)", text)
    assert "aten.embedding.default" in calls
    # a linear or layer norm reading parameters themselves: the straight-line entry points
    straight = re.findall(r"weight_grad\.(linear|layer_norm)\((?:  #[^\n]*)?\s*self, ", text)
    assert {"linear", "layer_norm"} <= set(straight)
    assert "aten.linear.default" not in calls and "aten.layer_norm.default" not in calls
    # every trainable parameter's gradient is W's: each appears in a deferred call's comment
    deferred_fqns = {f.strip() for line in re.findall(r"weight grads in W: (.*)", text) for f in line.split(",")}
    assert deferred_fqns == set(prog.chunks[0].params)
    fused, _ = _sources("1f1b")
    assert "weight_grad" not in fused        # other schedules keep the fused backward


def test_w_actions_carry_the_weight_gradients():
    """Dropping the W actions from the schedule leaves every deferred gradient unset."""
    w = load_workload("gpt", **TINY)
    pm = threefold.parallelize(w["model"], "m=1,schedule=zb-h1", w["inputs"], w["loss_fn"], target=w["target"])
    full = make_schedule("zb-h1", 1, 1)
    no_w = dataclasses.replace(full, actions=[[a for a in full.actions[0] if a.kind is not Kind.WEIGHT]])
    pm.engine.step((*w["inputs"], w["target"]), schedule=no_w)
    # every gradient but the layer norms' (left in B: runtime/weight_grad_ops.written_out)
    in_b = {n for n, p in pm.named_parameters() if p.grad is not None}
    assert in_b and all(".ln_" in f".{n}" for n in in_b), in_b
    assert all(p.grad is None for p in pm.parameters() if p.dim() > 1)
    pm.engine.step((*w["inputs"], w["target"]), schedule=full)
    assert all(p.grad is not None for p in pm.parameters())


def test_single_process_parity_with_the_split():
    ref = sgd_losses(load_workload("gpt", **TINY), 3)
    for plan in ("m=2,schedule=zb-h1", "m=1,schedule=zb-h1"):
        w = load_workload("gpt", **TINY)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        assert max_rel_diff(parallel_sgd_losses(pm, w, 3), ref) < 1e-5, plan
