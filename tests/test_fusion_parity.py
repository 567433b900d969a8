"""A whole model with fusion forced through Triton's interpreter equals the unfused graph:
loss and every parameter gradient (fp32, rtol 1e-5)."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

from tests.test_fusion_models import import_kernels
from threefold.codegen.triton import bind_kernels, kernels_source
from threefold.ir.program import tf
from threefold.compiler.trace import trace
from threefold.passes.fusion import fuse_graph
from threefold.runtime import kernels as rt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpt():
    spec = importlib.util.spec_from_file_location("tf_example_gpt", os.path.join(ROOT, "examples", "gpt.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["tf_example_gpt"] = module
    spec.loader.exec_module(module)
    return module


def run_graph(gm, prog, batch):
    """Run a Program's graph module: placeholders are params, buffers and inputs in order."""
    args, params = [], {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        ann = tf(node)
        if ann["kind"] == "param":
            params[ann["fqn"]] = prog.state[ann["fqn"]].clone().requires_grad_(True)
            args.append(params[ann["fqn"]])
        elif ann["kind"] == "buffer":
            args.append(prog.state[ann["fqn"]])
        else:
            args.append(batch[ann["input_index"]])
    (loss,) = gm(*args)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in params.items()}


def test_gpt_fused_through_interpreter_matches_unfused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THREEFOLD_KERNELS", "triton")
    gpt = _gpt()
    w = gpt.workload(n_layer=1, n_embd=32, seq=8, batch=2)
    batch = tuple(w["inputs"]) + (w["target"],)
    ref_prog = trace(w["model"], w["inputs"], w["target"], w["loss_fn"])
    ref_loss, ref_grads = run_graph(ref_prog.gm, ref_prog, batch)

    prog = trace(w["model"], w["inputs"], w["target"], w["loss_fn"])
    regions = fuse_graph(prog.gm)
    kinds = {r.kind for r in regions}
    assert {"bias_gelu", "bias_dropout_add", "softmax", "layer_norm"} <= kinds
    module = import_kernels(kernels_source(regions), tmp_path)
    assert bind_kernels(prog.gm, module) == len(regions)
    before = rt.launches["triton"]
    loss, grads = run_graph(prog.gm, prog, batch)
    assert rt.launches["triton"] - before >= len(regions)      # every fused node ran Triton

    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for fqn, g in ref_grads.items():
        torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{fqn}: {m}")
