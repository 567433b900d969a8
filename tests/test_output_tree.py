"""pm(x) returns what the eager model returns: a tensor for a tensor, and the same tuple,
list, dict, namedtuple or Hugging Face ModelOutput structure (recorded in the manifest at
compile time; the runtime rebuilds it)."""
from __future__ import annotations

import collections
import json

import pytest
import torch

import threefold
from threefold.runtime.output_tree import describe, rebuild

Pair = collections.namedtuple("Pair", "logits hidden")


class Body(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = self.b(h)
        if self.kind == "tensor":
            return y
        if self.kind == "tuple":
            return y, h
        if self.kind == "dict":
            return {"logits": y, "parts": [h, y * 2]}
        if self.kind == "namedtuple":
            return Pair(y, h)
        from transformers.modeling_outputs import BaseModelOutput
        return BaseModelOutput(last_hidden_state=y, hidden_states=(h,))


def _leaves(v):
    return [t for t in torch.utils._pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "namedtuple", "model_output"])
def test_call_returns_the_eager_structure(kind):
    if kind == "model_output":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, x = Body(kind), torch.randn(4, 8)
    with torch.no_grad():
        eager = model(x)
    pm = threefold.parallelize(model, "m=2", (x,))
    out = pm(x)
    assert type(out) is type(eager)
    if kind == "tensor":
        assert out.shape == eager.shape          # the README's `y.shape`
    if kind in ("dict", "model_output"):
        assert list(out.keys()) == list(eager.keys())
    got, want = _leaves(out), _leaves(eager)
    assert len(got) == len(want) and all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    # the structure is in the manifest, as JSON: an artifact's runtime rebuilds it alone
    assert json.loads(json.dumps(pm.manifest.to_json()))["output_tree"] == pm.manifest.output_tree


def test_with_a_loss_the_call_gives_the_models_structure():
    torch.manual_seed(0)
    model, x = Body("dict"), torch.randn(4, 8)
    loss_fn = lambda out, y: torch.nn.functional.mse_loss(out["logits"] + out["parts"][1], y) + out["parts"][0].mean()
    pm = threefold.parallelize(model, "", (x,), loss_fn, target=torch.zeros(4, 4))
    out = pm(x)
    with torch.no_grad():
        eager = model(x)
    assert set(out) == {"logits", "parts"} and isinstance(out["parts"], list)
    assert torch.allclose(out["parts"][1], eager["parts"][1], atol=1e-6)


def test_rebuild_without_the_class_imported_falls_back_to_plain_containers():
    tree = describe(Pair(torch.ones(1), torch.zeros(2)))
    tree["class"] = "not_imported_module:Pair"
    out = rebuild(tree, (torch.ones(1), torch.zeros(2)))
    assert isinstance(out, tuple) and len(out) == 2
    mapping = {"class": "nowhere:Output", "kind": "mapping", "keys": ["a"], "items": [{"tensor": 0}]}
    assert set(rebuild(mapping, (torch.ones(1),))) == {"a"}
    assert rebuild(None, (torch.ones(1),))[0].shape == (1,)     # an old artifact: the tuple
