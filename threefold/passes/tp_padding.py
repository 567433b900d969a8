"""Uneven shards of heads and features: a projection tp does not divide is padded.

A column-parallel weight whose 3 heads (or 33 output features) tp=2 does not divide is cut
as if it had 4 heads (34 features): the ShardSpec appends zero rows, whole heads per rank
(rank 0 holds heads 0-1, rank 1 head 2 and a zero head). Its row-parallel partner gets zero
input columns, so whatever the padding head computes adds nothing to the output, and the
gradient of those columns is masked (tp_ops.mask_padding), so they stay zero: the padded
model is the model. A padded value is recognised by its local size: local * tp exceeds the
traced (global) size along its shard dim.

Padding must never mix with real heads, so a padded shard passes only ops that treat each
head alone (elementwise on equal shapes, views that keep heads whole, transposes, matmuls
and attention with the heads as a batch dim, softmax / norms / reductions over other dims);
anything else gathers it and cuts the padding off (the fallback). If the padded shards of a
projection cannot be followed at all, the pass reruns with it kept whole (tensor_parallel).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.ops import families as fam
from threefold.passes.tp_placement import Shard
from threefold.passes.tp_rules import is_elementwise

# rules that handle padding themselves: the vocab-parallel cross-entropy (a vocabulary tp
# does not divide is padded too, and its padding never wins the softmax), the eager loss
# (gathers and cuts its inputs)
_OWN_PADDING = {"cross_entropy_loss", "call_loss"}
_ALONG = {"split": 2, "split_with_sizes": 2, "chunk": 2, "slice": 1, "narrow": 1, "select": 1,
          "index_select": 1, "softmax": 1, "_softmax": 1, "_safe_softmax": 1, "log_softmax": 1,
          "_log_softmax": 1, "cat": 1, "stack": 1}


def padded_size(rw, a: fx.Node) -> int | None:
    """The true size of a plain (not sequence, not block) shard whose ranks hold padding."""
    new = rw.env.get(a)
    p = rw.place.get(new)
    v, full = rw.val.get(new), a.meta.get("val")
    if not (isinstance(p, Shard) and not p.seq and not p.blocks and isinstance(v, torch.Tensor)
            and isinstance(full, torch.Tensor) and p.dim < v.dim() and p.dim < full.dim()):
        return None
    size = int(full.shape[p.dim])
    return size if v.shape[p.dim] * rw.t != size else None


def padding_ok(rw, old: fx.Node, padded: dict[fx.Node, int]) -> bool:
    """Whether `old` keeps each head of its padded inputs apart (see the module docstring)."""
    name = op_name(old)
    base = name[:-1] if name.endswith("_") else name
    dims = {rw.place[rw.env[a]].dim for a in padded}
    shards = [a for a in old.all_input_nodes if isinstance(rw.place.get(rw.env[a]), Shard)]
    # every sharded operand has the same true size along its shard dim: no size-1 dim
    # broadcast over padded heads (one k/v head shared by every query head)
    sizes = {int(a.meta["val"].shape[rw.place[rw.env[a]].dim]) for a in shards}
    if len(sizes) > 1:
        return False
    if base in fam.LAYOUT_ONLY or base in _OWN_PADDING:
        return True
    if is_elementwise(old):
        return True
    if base in fam.BATCHED_PRODUCTS:
        return all(rw.place[rw.env[a]].dim < a.meta["val"].dim() - 2 for a in shards)
    if base in _ALONG:
        x = old.args[0][0] if base in fam.JOINS else old.args[0]
        k = _arg(old, _ALONG[base], 0)
        ndim = x.meta["val"].dim() + (1 if base == "stack" else 0)
        return isinstance(k, int) and k % ndim not in dims
    return padding_safe(name, old, dims)


def _arg(old: fx.Node, i: int, default):
    if len(old.args) > i:
        return old.args[i]
    return old.kwargs.get("dim", default)


def padding_safe(name: str, old: fx.Node, dims: set) -> bool:
    """Whether `old` keeps the rows along `dims` (padded sequence shards) apart. What may run
    on a sequence shard whose last rank holds padding rows (a length tp does not divide):
    ops that treat each row alone (families.ROW_WISE). Anything that mixes rows along the
    padded dim runs on the gathered, cut value instead (the fallback)."""
    base = name[:-1] if name.endswith("_") and is_elementwise(old) else name
    x = old.args[0] if old.args else None
    ndim = x.meta["val"].dim() if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) else 0
    if base in ("layer_norm", "native_layer_norm", "rms_norm"):
        k = len(old.args[1]) if len(old.args) > 1 else 1
        return not dims & set(range(ndim - k, ndim))
    if base in fam.ROW_WISE or is_elementwise(old):
        return True
    if base in ("sum", "mean", "amax", "amin") and len(old.args) > 1 and old.args[1] is not None:
        reduced = old.args[1] if isinstance(old.args[1], (list, tuple)) else [old.args[1]]
        return not dims & {d % max(ndim, 1) for d in reduced}
    return False
