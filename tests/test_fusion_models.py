"""Tiny models, one per kind of fused region, and helpers the other fusion tests share.

Each CASE traces a small module with torch.export, runs the fusion pass on its graph and
keeps the one region it must produce. Sizes are odd on purpose (rows and columns that are
not powers of two) so the kernels' masked tails are exercised.
"""
from __future__ import annotations

import functools
import importlib.util
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from threefold.compiler.trace import trace
from threefold.passes.fusion import fuse_graph


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class BiasGelu(nn.Module):
    def __init__(self, k, n, approximate="none"):
        super().__init__()
        self.fc, self.approximate = nn.Linear(k, n), approximate

    def forward(self, x):
        return F.gelu(self.fc(x), approximate=self.approximate)


class BiasDropoutAdd(nn.Module):
    def __init__(self, n, p):
        super().__init__()
        self.fc, self.drop = nn.Linear(n, n), nn.Dropout(p)

    def forward(self, x, residual):
        return residual + self.drop(self.fc(x))


class ScaleMaskSoftmax(nn.Module):
    def forward(self, scores, mask):                    # mask: (1, 1, T, S) bool, True = hidden
        return (scores * 0.125).masked_fill(mask, float("-inf")).softmax(-1)


class CausalSoftmax(nn.Module):
    def forward(self, scores):
        t, s = scores.shape[-2:]
        keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
        return (scores * 0.125).masked_fill(~keep, float("-inf")).softmax(-1)


class HFRMSNorm(nn.Module):                              # Llama's RMSNorm, as Hugging Face writes it
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(n) + 0.5), eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLU(nn.Module):
    def forward(self, gate, up):
        return F.silu(gate) * up


class Rotary(nn.Module):
    def forward(self, x, cos, sin):
        return x * cos + rotate_half(x) * sin


class Elementwise(nn.Module):
    """A general chain with every broadcast pattern: full, col, row, scalar and general."""

    def forward(self, x, col, row, scalar, gen):
        y = torch.tanh(x * col + row) * torch.sigmoid(x) - scalar.exp()
        return (y / (1.0 + gen * gen)).relu() + torch.sqrt(x * x + 1.0)


class ElementwiseMath(nn.Module):
    """Every other elementwise op the pass fuses, in one chain."""

    def forward(self, x, y, m):
        a = torch.exp(-x) + torch.log(y * y + 1.0) - torch.erf(x) * torch.sin(y) / (2.0 - torch.cos(x))
        b = (y * y + 1.0).reciprocal().pow(3) + (y * y + 0.5).pow(-0.5) + (x * x + 0.1).sqrt().pow(-1)
        c = torch.where(m, a, b) - F.silu(x) + torch.sigmoid(y).pow(2) * 0.5 - 1.5
        d = (c * 1.5).to(torch.bfloat16).to(x.dtype)
        return d.masked_fill(m, 0.25) / (1.0 + torch.rsqrt(y * y + 1.0)) + torch.relu(x).clone()


def _ln(n):
    m = nn.LayerNorm(n)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
    return m


# name -> (expected kernel kind, expected kernel name, factory(dtype) -> (module, inputs))
CASES = {
    "bias_gelu_erf": ("bias_gelu", "bias_gelu_erf",
                      lambda dt: (BiasGelu(7, 130), (torch.randn(37, 7, dtype=dt),))),
    "bias_gelu_tanh": ("bias_gelu", "bias_gelu_tanh",
                       lambda dt: (BiasGelu(7, 37, "tanh"), (torch.randn(3, 5, 7, dtype=dt),))),
    "bias_dropout_add": ("bias_dropout_add", "bias_dropout_add",
                         lambda dt: (BiasDropoutAdd(37, 0.0), (torch.randn(3, 5, 37, dtype=dt),
                                                               torch.randn(3, 5, 37, dtype=dt)))),
    "scale_mask_softmax": ("softmax", "scale_mask_softmax",
                           lambda dt: (ScaleMaskSoftmax(), (torch.randn(2, 3, 5, 37, dtype=dt),
                                                            torch.rand(1, 1, 5, 37) > 0.7))),
    "causal_softmax": ("softmax", "scale_causal_mask_softmax",
                       lambda dt: (CausalSoftmax(), (torch.randn(2, 3, 13, 13, dtype=dt),))),
    "layer_norm": ("layer_norm", "layer_norm", lambda dt: (_ln(130), (torch.randn(5, 3, 130, dtype=dt),))),
    "rms_norm": ("rms_norm", "rms_norm", lambda dt: (nn.RMSNorm(130, eps=1e-6), (torch.randn(5, 130, dtype=dt),))),
    "hf_rms_norm": ("rms_norm", "rms_norm", lambda dt: (HFRMSNorm(37), (torch.randn(3, 5, 37, dtype=dt),))),
    "swiglu": ("swiglu", "swiglu", lambda dt: (SwiGLU(), (torch.randn(5, 130, dtype=dt), torch.randn(5, 130, dtype=dt)))),
    "rotary": ("rotary", "rotary", lambda dt: (Rotary(), (torch.randn(2, 3, 5, 16, dtype=dt),
                                                          torch.randn(5, 16, dtype=dt), torch.randn(5, 16, dtype=dt)))),
    "elementwise": ("elementwise", None,
                    lambda dt: (Elementwise(), (torch.randn(3, 5, 37, dtype=dt), torch.randn(37, dtype=dt),
                                                torch.randn(3, 5, 1, dtype=dt), torch.randn((), dtype=dt),
                                                torch.randn(3, 1, 37, dtype=dt)))),
    "elementwise_math": ("elementwise", None,
                         lambda dt: (ElementwiseMath(), (torch.randn(3, 37, dtype=dt), torch.randn(3, 37, dtype=dt),
                                                         torch.rand(3, 37) > 0.5))),
}


@functools.lru_cache(maxsize=None)
def region_for(case: str, dtype: torch.dtype = torch.float32):
    """Trace CASES[case] in `dtype`, fuse, and return its single FusedRegion."""
    torch.manual_seed(0)
    model, inputs = CASES[case][2](dtype)
    model = model.to(dtype)
    prog = trace(model, inputs)
    regions = fuse_graph(prog.gm)
    assert len(regions) == 1, f"{case}: expected one region, got {regions}"
    return regions[0]


def import_kernels(source: str, directory, name: str = "kernels"):
    """Write kernels.py to `directory` and import it from there (Triton's @jit reads the file)."""
    path = directory / f"{name}.py"
    path.write_text(source)
    modname = f"tf_test_{name}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_makes_its_region(case):
    kind, name, _ = CASES[case]
    region = region_for(case)
    assert region.kind == kind
    if name is not None:
        assert region.kernel_name == name
    # The region's eager call is the model's own computation.
    torch.manual_seed(0)
    model, inputs = CASES[case][2](torch.float32)
    expected = model(*inputs)
    prog = trace(model, inputs)
    fuse_graph(prog.gm)
    args = [prog.state[n.meta["tf"]["fqn"]] if n.meta["tf"]["kind"] != "input" else inputs[n.meta["tf"]["input_index"]]
            for n in prog.gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(prog.gm(*args)[0], expected, rtol=1e-6, atol=1e-6)
