"""Front end: torch.export of unmodified models (with their loss) into a Program."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.foundation_helpers import workload
from threefold.ir.program import compute_nodes, format_program, tf
from threefold.compiler.trace import trace
from threefold.errors import PlanError


def _trace(w):
    return trace(w["model"], w["inputs"], w["target"], w["loss_fn"])


def _check_program(prog, model):
    # every compute node has a shape and dtype (tuple-valued ones: a list of them)
    for node in compute_nodes(prog.graph):
        assert "val" in node.meta, node.name
    # parameters keep their FQNs (canonical name for tied ones), each once
    fqns = prog.param_names()
    assert len(fqns) == len(set(fqns))
    expected = [name for name, _ in model.named_parameters()]  # duplicates removed = canonical
    assert sorted(fqns) == sorted(expected)
    for fqn in fqns:
        assert prog.state[fqn].shape == dict(model.named_parameters())[fqn].shape
    # the loss is in the graph: one scalar output
    assert prog.has_loss and prog.output_meta[0].numel == 1


def test_gpt_example_traces_with_names_ties_and_loss():
    w = workload("gpt", n_layer=2)
    prog = _trace(w)
    _check_program(prog, w["model"])
    assert prog.ties == {"wte.weight": ["wte.weight", "lm_head.weight"]}
    assert list(prog.input_names) == ["idx", "target"]          # forward's parameter names + target
    names = {n.name for n in prog.graph.nodes if n.op == "placeholder"}
    assert {"p_wte_weight", "p_h_1_attn_c_attn_weight", "b_h_0_attn_mask", "idx", "target"} <= names
    # the lm head reads the embedding's placeholder: one tensor, two uses
    wte = next(n for n in prog.graph.nodes if n.name == "p_wte_weight")
    assert {u.target for u in wte.users} == {torch.ops.aten.embedding.default, torch.ops.aten.linear.default}
    # module paths are the model's own FQNs
    assert {tf(n).get("module") for n in compute_nodes(prog.graph)} >= {"h.0.attn.c_attn", "lm_head", "wte"}
    text = format_program(prog)
    assert "%p_wte_weight = param wte.weight  [96, 64]:float32" in text
    assert "aten.cross_entropy_loss" in text


def test_meta_model_traces_without_memory():
    w = workload("gpt", n_layer=2, n_embd=1024, n_head=16, vocab_size=50304, seq=1024, batch=1,
                 device="meta")
    prog = _trace(w)
    assert prog.is_meta and all(t.is_meta for t in prog.state.values())
    _check_program(prog, w["model"])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models_trace(name):
    w = workload(name, n_layer=2)
    prog = _trace(w)
    _check_program(prog, w["model"])
    assert list(prog.input_names) == ["input_ids", "target"]
    modules = {tf(n).get("module") for n in compute_nodes(prog.graph)}
    layer = "model.transformer.h.1" if name == "gpt2" else "model.model.layers.1"
    assert any(m.startswith(layer + ".") for m in modules), sorted(modules)[:10]


def test_llama_tied_embedding_detected():
    w = workload("llama", n_layer=1, tie=True)
    prog = _trace(w)
    assert prog.ties == {"model.model.embed_tokens.weight": ["model.model.embed_tokens.weight",
                                                           "model.lm_head.weight"]}


def test_sequential_stack_traces():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    prog = trace(model, (torch.randn(2, 8),), torch.randn(2, 4), F.mse_loss)
    _check_program(prog, model)
    assert prog.param_names() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert len(prog.input_names) == 2 and prog.input_names[1] == "target"


def test_forward_only_trace():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    prog = trace(model, (torch.randn(3, 4),))
    assert not prog.has_loss and prog.output_meta[0].shape == (3, 4)


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


def test_untraceable_model_names_model_construct_and_fix():
    with pytest.raises(PlanError) as err:
        trace(DataDependent(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "\n" not in msg
    assert "DataDependent" in msg
    assert "if y.sum() > 0:" in msg and "test_foundation_trace.py" in msg
    assert "torch.where" in msg


def test_loss_without_target_is_an_error():
    with pytest.raises(PlanError, match="no target"):
        trace(torch.nn.Linear(2, 2), (torch.randn(1, 2),), None, F.mse_loss)
