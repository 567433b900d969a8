"""The decoder the planner's shape flags describe (planner/reference_layer.py): its saved
activations are what autograd keeps on a real run, and the flags read theirs off it."""
from __future__ import annotations

import torch

from threefold.planner.reference_layer import Decoder, _loss

SMALL = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64, tied=False)


def _autograd_saved_by_block0(model, ids) -> int:
    """Bytes of the unique non-parameter storages autograd keeps during block 0's forward."""
    state = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}
    active = [False]

    def pack(t):
        key = t.untyped_storage()._cdata
        if active[0] and key not in state:
            seen[key] = t.untyped_storage().nbytes()
        return t
    block = model.layers[0]
    block.register_forward_pre_hook(lambda *a: active.__setitem__(0, True))
    block.register_forward_hook(lambda *a: active.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model(ids), ids)
    return sum(seen.values())


def _graph_saved_by_block0(model, ids) -> int:
    from threefold.ir.program import compute_nodes, tf
    from threefold.compiler.trace import trace
    from threefold.planner.saved_bytes import nodes_saved
    traced = trace(model, (ids,), ids, _loss)
    block0 = [n.name for n in compute_nodes(traced.graph) if (tf(n).get("module") or "").startswith("layers.0")]
    assert block0
    return sum(b for b, _ in nodes_saved(traced.gm, block0).values())


def test_the_reference_decoders_saved_bytes_are_what_autograd_keeps():
    """saved_bytes.py's count for one layer of the reference decoder (dense and MoE) equals
    what autograd keeps while that layer runs forward on this machine: the flags' activation
    figures are a measurement of this model, not a formula."""
    torch.manual_seed(0)
    for extra in ({}, dict(experts=4, top_k=2)):
        model = Decoder(**SMALL, **extra)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        ids = torch.randint(0, SMALL["vocab"], (2, 16))
        assert _graph_saved_by_block0(model, ids) == _autograd_saved_by_block0(model, ids), extra


def test_flags_take_their_activations_from_the_reference_decoder():
    """gpt_model_cost's swiglu shape carries exactly the reference decoder's figures."""
    from threefold.planner.gpt_cost import gpt_model_cost
    from threefold.planner.reference_layer import ACTIVATION_FIELDS, flags_activations
    cost = gpt_model_cost(4, 64, 8, 128, 32, ffn=96, kv_heads=2, mlp="swiglu", tied=False)
    found = flags_activations(64, 8, 2, 96, 128, 32, False)
    assert {k: getattr(cost, k) for k in ACTIVATION_FIELDS} == found
    assert found["act_split"] > 0 and found["act_repl"] > 0
    # more experts' rows per token (top-k) keep more
    moe1 = flags_activations(64, 8, 2, 96, 128, 32, False, 4, 1)["act_split"]
    moe2 = flags_activations(64, 8, 2, 96, 128, 32, False, 4, 2)["act_split"]
    assert moe2 > moe1
