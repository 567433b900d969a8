"""The fusion pass on graphs: which regions it finds, that the rewritten graph is well formed
and computes the same values, naming, the plan switch, and run-time dispatch rules."""
from __future__ import annotations

import ast
import collections
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.test_fusion_models import BiasDropoutAdd
from tests.test_fusion_parity import _gpt, run_graph
from threefold.codegen.triton_rules import BWD, FWD
from threefold.ir.stages import Chunk, Fused, Partitioned
from threefold.compiler.trace import trace
from threefold.passes.fusion import fuse, fuse_graph, split_linear_bias
from threefold.passes.fusion_regions import ELEMENTWISE, ROW_OPS, FusedRegion
from threefold.plan import Plan
from threefold.runtime import kernels as rt


def _gpt_prog(n_layer=2, plan=None):
    w = _gpt().workload(n_layer=n_layer, n_embd=32, seq=8, batch=2)
    prog = trace(w["model"], w["inputs"], w["target"], w["loss_fn"], plan=plan)
    return prog, tuple(w["inputs"]) + (w["target"],)


def _fused_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, FusedRegion)]


def test_gpt_regions_and_kernel_sharing():
    prog, _ = _gpt_prog(n_layer=2)
    regions = fuse_graph(prog.gm)
    counts = collections.Counter(r.kernel_name for r in regions)
    # per layer: 2 LayerNorms, 1 softmax, 2 bias-dropout-adds, 1 bias-GeLU; plus ln_f and the
    # embedding add + dropout
    assert counts == {"layer_norm": 5, "scale_mask_softmax": 2, "bias_dropout_add": 4,
                      "bias_gelu_erf": 2, "ew_add_dropout": 1}
    assert len({r.kernel_name: r.signature for r in regions}) == 5   # identical regions share a name
    gelu = next(r for r in regions if r.kind == "bias_gelu")
    assert [i.pattern for i in gelu.inputs] == ["full", "col"]


def test_fused_graph_is_well_formed_and_computes_the_same():
    ref, batch = _gpt_prog(n_layer=2)
    ref_loss, ref_grads = run_graph(ref.gm, ref, batch)
    prog, _ = _gpt_prog(n_layer=2)
    fuse_graph(prog.gm)
    prog.gm.graph.lint()
    for node in prog.gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta, node.name
    fused = _fused_nodes(prog.gm)
    assert fused and all(n.meta["tf"]["fused"] == n.target.kernel_name for n in fused)
    assert not any(str(n.target) in ("aten.gelu.default", "aten.layer_norm.default", "aten.softmax.int")
                   for n in prog.gm.graph.nodes)
    loss, grads = run_graph(prog.gm, prog, batch)             # regions run their eager ops
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)


def _as_chunks(*progs):
    """A Partitioned stage whose chunks are whole traced graphs (fusion reads only chunk graphs)."""
    chunks = tuple(Chunk(index=i, gm=p.gm, nodes=(), inputs=(), outputs=(), user_inputs=(), params=(), buffers=())
                   for i, p in enumerate(progs))
    return progs[0].advance(Partitioned, chunks=chunks)


def test_fuse_follows_the_plan_and_fuses_every_chunk():
    off, _ = _gpt_prog(n_layer=1, plan=Plan(fuse=False))
    code = off.gm.code
    out = fuse(_as_chunks(off))
    assert isinstance(out, Fused) and out.chunks[0].gm is off.gm and off.gm.code == code and not out.kernels
    auto, _ = _gpt_prog(n_layer=1)                                # fuse=None, CPU tensors: off
    out = fuse(_as_chunks(auto))
    assert not out.kernels and not _fused_nodes(out.chunks[0].gm)

    prog, _ = _gpt_prog(n_layer=1, plan=Plan(fuse=True))
    other, _ = _gpt_prog(n_layer=1)
    before = prog.gm.code
    prog = fuse(_as_chunks(prog, other))
    assert _as_chunks(other).chunks[0].gm.code == other.gm.code and not _fused_nodes(other.gm)  # inputs untouched
    assert before == prog.chunks[0].gm.code or _fused_nodes(prog.chunks[0].gm)
    assert set(prog.kernels) == {"layer_norm", "scale_mask_softmax", "bias_dropout_add", "bias_gelu_erf",
                                 "ew_add_dropout"}
    names = [sorted(n.target.kernel_name for n in _fused_nodes(c.gm)) for c in prog.chunks]
    assert names[0] == names[1]                                   # one naming table for all chunks
    assert any(note.startswith("fusion:") for note in prog.notes)


class TwoDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = BiasDropoutAdd(16, 0.0), BiasDropoutAdd(16, 0.1)

    def forward(self, x):
        return self.a(x, x), self.b(x, x)


def test_different_constants_get_different_names():
    prog = trace(TwoDropouts(), (torch.randn(3, 16),))
    names = sorted(r.kernel_name for r in fuse_graph(prog.gm))
    assert names == ["bias_dropout_add", "bias_dropout_add_2"]


class Cycle(nn.Module):
    """h feeds both the region (through tanh) and a matmul that feeds the region again:
    fusing h into the region would make a cycle."""

    def forward(self, x, w):
        h = x + 1.0
        return torch.tanh(h) + h @ w


def test_no_region_that_would_make_a_cycle():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    prog = trace(Cycle(), (x, w))
    regions = fuse_graph(prog.gm)
    assert [r.source_nodes for r in regions] == [["tanh", "add_1"]]
    prog.gm.graph.lint()
    torch.testing.assert_close(prog.gm(x, w)[0], Cycle()(x, w))


class MultiOut(nn.Module):
    def forward(self, x, b):
        h = x * b
        return torch.sigmoid(h) + 1.0, h.sum()


def test_region_with_two_outputs_uses_getitem():
    x, b = torch.randn(3, 5), torch.randn(5)
    prog = trace(MultiOut(), (x, b))
    (region,) = fuse_graph(prog.gm)
    assert len(region.outputs) == 2
    getitems = [n for n in prog.gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "getitem"]
    assert len(getitems) == 2 and all(isinstance(n.meta["val"], torch.Tensor) for n in getitems)
    a, s = prog.gm(x, b)
    ea, es = MultiOut()(x, b)
    torch.testing.assert_close(a, ea)
    torch.testing.assert_close(s, es)


class LinearUsers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return F.gelu(self.fc1(x)), self.fc2(x).sum()


def test_bias_leaves_linear_only_for_elementwise_users():
    prog = trace(LinearUsers(), (torch.randn(2, 8),))
    split_linear_bias(prog.gm.graph)
    linears = [n for n in prog.gm.graph.nodes if str(n.target) == "aten.linear.default"]
    assert sorted(len(n.args) for n in linears) == [2, 3]


def test_every_fusible_op_has_a_triton_rule():
    shorts = set(ELEMENTWISE.values()) | set(ROW_OPS.values())
    assert shorts <= set(FWD) and shorts <= set(BWD)


@pytest.mark.parametrize("shape,out,pattern", [
    ((3, 5), (3, 5), "full"), ((5,), (3, 5), "col"), ((1, 1, 5), (2, 3, 5), "col"),
    ((3, 1), (3, 5), "row"), ((), (3, 5), "scalar"), ((1, 1), (3, 5), "scalar"),
    ((1, 4, 5), (2, 4, 5), "general"), ((2, 1, 5), (2, 4, 5), "general"), ((3, 4), (3, 5), "invalid"),
])
def test_patterns(shape, out, pattern):
    assert rt.pattern_of(shape, out) == pattern


def test_dispatch_rules(monkeypatch):
    class InterpretedFunction:      # what triton.jit makes under TRITON_INTERPRET=1
        pass

    kernel, t = InterpretedFunction(), torch.zeros(2)
    monkeypatch.delenv("THREEFOLD_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not rt.use_triton(kernel, t)                          # CPU: eager
    monkeypatch.setenv("THREEFOLD_KERNELS", "triton")
    assert not rt.use_triton(kernel, t)                          # ... unless interpreting
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert rt.use_triton(kernel, t)
    assert not rt.use_triton(object(), t)                        # a compiled kernel cannot take CPU tensors
    assert not rt.use_triton(kernel, torch.zeros(2, device="meta"))
    monkeypatch.setenv("THREEFOLD_KERNELS", "eager")
    assert not rt.use_triton(kernel, t)


def test_runtime_kernels_does_not_import_the_compiler():
    tree = ast.parse(pathlib.Path(rt.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.startswith(("threefold.compiler", "threefold.passes", "threefold.codegen"))]
