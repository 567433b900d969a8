"""Rewrites of the traced graph that remove what a model computes only for inference, or
that does nothing at all.

Hugging Face key/value caches (use_cache=True, the default of most configs) start each
layer's cache as `torch.tensor([])` and append with `torch.cat([cache, new], dim=-2)`.
torch.cat skips a 1-D empty input ("legacy" empty tensors), so the cat is the new keys
as they are; but to the tensor-parallel rules it is a cat of a 1-D value with a 4-D one.
We drop such inputs from every cat; the empty tensor then has no users and goes with the
dead code, and cache outputs the loss does not read were already dropped with it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

_CAT = torch.ops.aten.cat.default


def _legacy_empty(value) -> bool:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == 0


def drop_empty_cat_inputs(graph: fx.Graph) -> int:
    """Remove 1-D empty tensors from aten.cat's inputs (torch.cat ignores them); how many."""
    dropped = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _CAT:
            continue
        tensors = list(node.args[0])
        kept = [t for t in tensors if not _legacy_empty(t)]
        if len(kept) == len(tensors) or not kept:
            continue   # nothing to drop, or every input empty: the cat is empty and stays
        node.args = (kept, *node.args[1:])
        dropped += len(tensors) - len(kept)
    return dropped


_ONE = {torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar, torch.ops.aten.div_.Tensor,
        torch.ops.aten.div_.Scalar}
_ZERO = {torch.ops.aten.add_.Tensor, torch.ops.aten.add_.Scalar, torch.ops.aten.sub_.Tensor,
         torch.ops.aten.sub_.Scalar}


def drop_identity_inplace(graph: fx.Graph) -> int:
    """Remove in-place ops that leave their input as it is: `x.mul_(1)`, `x.div_(1)`,
    `x.add_(0)`, `x.sub_(0)` with a Python number. Hugging Face RWKV rescales its output
    weights in forward under no_grad by 2 ** (block // rescale_every), which is 1 for the
    first blocks; traced, that is an in-place op on a parameter, which autograd refuses on a
    leaf (a pipeline chunk's parameters are leaves). How many were removed."""
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or len(node.args) < 2:
            continue
        other = node.args[1]
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            continue
        if (node.target in _ONE and other == 1) or (node.target in _ZERO and other == 0):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            dropped += 1
    return dropped
