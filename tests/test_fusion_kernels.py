"""Every generated kernel, forward and backward, against eager ATen on CPU under Triton's
interpreter (TRITON_INTERPRET=1, THREEFOLD_KERNELS=triton): fp32 tight, bf16 looser."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.test_fusion_models import CASES, BiasDropoutAdd, import_kernels, region_for
from threefold.codegen.triton import kernels_source
from threefold.compiler.trace import trace
from threefold.passes.fusion import fuse_graph
from threefold.runtime import kernels as rt

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: None}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THREEFOLD_KERNELS", "triton")


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles far smaller than the tensors: several row and column tiles, and backward
    programs that loop over more than one row tile."""
    monkeypatch.setattr(rt, "EW_TILE", 64)
    monkeypatch.setattr(rt, "EW_MAX_BLOCK_N", 16)
    monkeypatch.setattr(rt, "ROW_TILE", 32)


def make_inputs(region, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = []
    for inp in region.inputs:
        if inp.dtype == torch.bool:
            m = torch.rand(inp.shape, generator=g) > 0.7
            m[..., 0] = False                      # no row is masked out entirely
            xs.append(m)
        else:
            xs.append(torch.randn(inp.shape, generator=g).to(inp.dtype))
    return xs


def _as_tuple(y):
    return y if isinstance(y, tuple) else (y,)


def _run(fn, xs, gouts=None, seed=1):
    """Outputs of fn(*xs) and the gradients of its floating inputs (for random output grads)."""
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in xs]
    ys = _as_tuple(fn(*leaves))
    if gouts is None:
        g = torch.Generator().manual_seed(seed)
        gouts = [torch.randn(y.shape, generator=g).to(y.dtype) for y in ys]
    torch.autograd.backward(ys, [g.to(y.dtype) for g, y in zip(gouts, ys)])
    return [y.detach() for y in ys], [x.grad for x in leaves if x.is_floating_point()], gouts


def check_kernel(region, module, xs, tol=None):
    """The generated kernel against the region's eager ops: outputs and input gradients.

    fp32: within `tol`. bf16: eager rounds after every op and the kernel only at the end,
    so both are measured against fp32 eager on the same inputs, and the kernel's error
    may be at most 1.5x eager's (or 1% of the values' scale)."""
    fn = getattr(module, region.kernel_name)
    before = rt.launches["triton"]
    yf, gf, gouts = _run(fn, xs)
    assert rt.launches["triton"] > before, "the Triton path did not run"
    ye, ge, _ = _run(region, xs, gouts)
    for u, v in zip(yf, ye):
        assert u.dtype == v.dtype and u.shape == v.shape
    assert all(g is not None for g in gf), "an input got no gradient"
    if tol is not None:
        for k, (u, v) in enumerate(zip(yf + gf, ye + ge)):
            torch.testing.assert_close(u, v, **tol, msg=lambda m: f"value {k} (outputs, then grads): {m}")
        return
    yr, gr, _ = _run(region, [x.float() if x.is_floating_point() else x for x in xs], gouts)
    for k, (u, v, r) in enumerate(zip(yf + gf, ye + ge, yr + gr)):
        err_fused = (u.float() - r).abs().max().item()
        err_eager = (v.float() - r).abs().max().item()
        scale = max(1.0, r.abs().max().item())
        assert err_fused <= max(1.5 * err_eager, 1e-2 * scale), (k, err_fused, err_eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_eager(case, dtype, interpret, tmp_path):
    region = region_for(case, dtype)
    module = import_kernels(kernels_source([region]), tmp_path)
    xs = make_inputs(region)
    check_kernel(region, module, xs, TOL[dtype])
    # The generated eager function is the region's own op list.
    eager = getattr(module, region.kernel_name + "_eager")
    for u, v in zip(_as_tuple(eager(*xs)), _as_tuple(region(*xs))):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_with_many_tiles(case, interpret, tiny_tiles, tmp_path):
    region = region_for(case)
    module = import_kernels(kernels_source([region]), tmp_path)
    check_kernel(region, module, make_inputs(region, seed=3), TOL[torch.float32])


def test_inputs_that_need_no_grad_and_other_shapes_fall_back(interpret, tmp_path):
    region = region_for("layer_norm")
    module = import_kernels(kernels_source([region]), tmp_path)
    x, w, b = make_inputs(region)
    w.requires_grad_(True)                          # only the weight wants a gradient
    y = module.layer_norm(x, w, b)
    y.sum().backward()
    ref = w.detach().clone().requires_grad_(True)
    region(x, ref, b).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad, **TOL[torch.float32])
    # A call whose broadcast pattern or dtype differs from the traced one runs eager.
    swiglu = region_for("swiglu")
    module = import_kernels(kernels_source([swiglu]), tmp_path, "swiglu_kernels")
    a, b = make_inputs(swiglu)
    before = rt.launches["triton"]
    for args in ((a, b[:1]), (a.double(), b.double())):
        torch.testing.assert_close(module.swiglu(*args), swiglu(*args), rtol=0, atol=0)
    assert rt.launches["triton"] == before


def test_cpu_runs_eager_unless_interpreter_is_forced(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    region = region_for("swiglu")
    module = import_kernels(kernels_source([region]), tmp_path)
    xs = make_inputs(region)
    monkeypatch.delenv("THREEFOLD_KERNELS", raising=False)
    before = rt.launches["triton"]
    torch.testing.assert_close(module.swiglu(*xs), region(*xs), rtol=0, atol=0)
    assert rt.launches["triton"] == before


class TwoOutputs(nn.Module):
    def forward(self, x, b):
        h = x + b                                   # used inside the region and by the sum
        return torch.tanh(h) * 2.0, h.sum(-1)


def test_region_with_two_outputs(interpret, tmp_path):
    prog = trace(TwoOutputs(), (torch.randn(5, 37), torch.randn(37)))
    regions = fuse_graph(prog.gm)
    assert len(regions) == 1 and len(regions[0].outputs) == 2
    module = import_kernels(kernels_source(regions), tmp_path)
    check_kernel(regions[0], module, make_inputs(regions[0]), TOL[torch.float32])


def _dropout_region(p):
    prog = trace(BiasDropoutAdd(130, p), (torch.randn(64, 130), torch.randn(64, 130)))
    (region,) = fuse_graph(prog.gm)
    return region


def test_dropout_statistics_and_backward_mask(interpret, tmp_path):
    p = 0.3
    region = _dropout_region(p)
    assert region.kind == "bias_dropout_add"
    module = import_kernels(kernels_source([region]), tmp_path)
    y, b, r = make_inputs(region)
    y.requires_grad_(True)
    b.requires_grad_(True)
    torch.manual_seed(0)
    out = module.bias_dropout_add(y, b, r)
    z = (out - r).detach()
    kept = z != 0
    frac_zero = 1.0 - kept.float().mean().item()
    assert abs(frac_zero - p) < 0.03, frac_zero
    scaled = (y + b).detach() / (1 - p)
    torch.testing.assert_close(z[kept], scaled[kept], rtol=1e-5, atol=1e-5)
    assert abs(z.mean().item() - (y + b).mean().item()) < 0.05    # E[dropout(v)] = v
    g = torch.randn_like(out)
    out.backward(g)
    expect = g * kept / (1 - p)                    # backward recomputes the same mask from the seed
    torch.testing.assert_close(y.grad, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, expect.sum(0), rtol=1e-4, atol=1e-4)
    # The same torch seed gives the same mask; a new draw gives another.
    torch.manual_seed(0)
    assert torch.equal(module.bias_dropout_add(y, b, r), out)
    assert not torch.equal(module.bias_dropout_add(y, b, r), out)
