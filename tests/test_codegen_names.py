"""Tier 1: codegen's value names and line annotations on a hand-built graph, and the
one-place rules the generated code and the runtime share (stage of a chunk, tied-parameter
stage sets, scatter/gather)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from threefold.codegen.python import annotation, value_names
from threefold.runtime.boundary import is_scattered, sent_elements
from threefold.runtime.mesh import Mesh, stage_of
from threefold.runtime.ties import tied_param_stages

aten = torch.ops.aten


def _node(g, target, args, module, placement=None, val=None):
    n = g.call_function(target, args)
    n.meta["tf"] = {"module": module, **({"placement": placement} if placement else {})}
    if val is not None:
        n.meta["val"] = val
    return n


def test_names_come_from_modules_and_ops():
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    proj = _node(g, aten.mm.default, (x, w), "h.0.attn.c_proj", "P", torch.empty(4, 8))
    bias = _node(g, aten.add.Tensor, (proj, x), "h.0.attn.c_proj", "R", torch.empty(4, 8))
    ln = _node(g, aten.layer_norm.default, (bias, [8]), "h.0.ln_1", None, torch.empty(4, 8))
    act = _node(g, aten.gelu.default, (ln,), "h.0.mlp")              # h.0.mlp has a child below
    fc = _node(g, aten.mm.default, (act, w), "h.0.mlp.c_fc")
    parts = _node(g, aten.split.Tensor, (fc, 4), "h.0.mlp", "(S(1), S(1))",
                  [torch.empty(4, 4), torch.empty(4, 4)])
    first = _node(g, operator.getitem, (parts, 0), "h.0.mlp")
    loss = _node(g, aten.sum.default, (first,), "")
    names = value_names(g, {"x", "w"})
    assert names[proj] == "h0_attn_c_proj_mm" and names[bias] == "h0_attn_c_proj_add"
    assert names[ln] == "h0_ln_1"                      # a leaf module's only op: its path
    assert names[fc] == "h0_mlp_c_fc"
    assert names[act] == "h0_mlp_gelu"                 # not a leaf: path + op
    assert names[parts] == "h0_mlp_split" and names[first] == "h0_mlp_split_0"
    assert names[loss] == "sum"                        # top level: the op alone
    assert annotation(proj) == "h.0.attn.c_proj  P  [4, 8]"
    assert annotation(ln) == "h.0.ln_1  R  [4, 8]"     # tp=1 (no placement): replicated
    assert annotation(parts) == "h.0.mlp  (S(1), S(1))  [4, 4] x2"


def test_names_never_collide_with_arguments_or_each_other():
    g = fx.Graph()
    x = g.placeholder("h0_ln_1")
    a = _node(g, aten.relu.default, (x,), "h.0.ln_1")
    b = _node(g, aten.relu.default, (a,), "h.0.act")
    c = _node(g, aten.relu.default, (b,), "h.0.act")
    names = value_names(g, {"h0_ln_1"})
    assert names[a] == "h0_ln_1_1" and {names[b], names[c]} == {"h0_act_relu", "h0_act_relu_1"}


def test_one_place_rules():
    assert [stage_of(c, 4) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    mesh = Mesh(tp=2, dp=2, pp=2)
    assert mesh.stage_ranks(1) == [4, 5, 6, 7] == sorted(mesh.rank(tp=t, dp=d, pp=1) for t in (0, 1) for d in (0, 1))
    chunks = [{"shared_params": {"wte.weight": [0, 7]}}, {"shared_params": {"b": [1, 5]}}]
    assert tied_param_stages(chunks, 4) == {"wte.weight": (0, 3)}   # b: chunks 1 and 5, both stage 1
    assert is_scattered("R", 16, 2, True) and not is_scattered("S(2)", 16, 2, True)
    assert not is_scattered("R", 15, 2, True) and not is_scattered("R", 16, 2, False)
    assert sent_elements("R", 16, 2, True) == 8 and sent_elements("R(f)", 16, 2, True) == 16
