"""Recognising an expert matmul in a graph: a grouped matmul of token rows by a stacked
[E, ...] expert weight, read through views that keep the experts on dim 0. The expert pass
(passes/experts.py), the batch-row rules (row_rules.py) and batch_coupling.py all ask it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.passes.cost import op_name

# Ops that take a view or a cast of an expert weight and keep its experts on dim 0 as long
# as the dim they work on is not 0 (gate and up interleaved in one parameter, read as
# w[..., ::2] and w[..., 1::2]; a transpose of the last two dims; autocast's cast). They carry
# no sizes, so the same op on this rank's E/ep experts gives those experts' views.
_WEIGHT_VIEWS = {"transpose": ("dim0", "dim1"), "swapaxes": ("dim0", "dim1"), "slice": ("dim",),
                 "select": ("dim",), "narrow": ("dim",), "unsqueeze": ("dim",), "squeeze": ("dim",),
                 "t": (), "permute": ("dims",), "alias": (), "contiguous": (), "clone": (),
                 "_to_copy": (), "to": (), "detach": ()}

def expert_matmul(node: fx.Node):
    """(rows, weight operand, parameter placeholder, offsets) of an expert matmul, else None."""
    if node.op != "call_function":
        return None
    tensors = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, fx.Node)]
    if len(tensors) != 3:
        return None
    x, w, offs = tensors
    vx, vw, vo, out = (_val(n) for n in (x, w, offs, node))
    if not all(isinstance(v, torch.Tensor) for v in (vx, vw, vo, out)):
        return None
    if vx.dim() != 2 or vw.dim() != 3 or vo.dim() != 1 or out.dim() != 2:
        return None
    if vo.dtype.is_floating_point or vo.shape[0] != vw.shape[0] or out.shape[0] != vx.shape[0]:
        return None
    if vx.shape[1] != vw.shape[1] or out.shape[1] != vw.shape[2]:
        return None
    param = _param_root(w)
    if param is None:
        return None
    return x, w, param, offs


def _param_root(w: fx.Node):
    """The parameter placeholder [E, ...] a weight operand is a view or cast of, through
    ops that keep the experts on dim 0 (_WEIGHT_VIEWS), else None."""
    for n in weight_chain(w):
        if n.op == "placeholder":
            return n if tf(n).get("kind") == "param" and _val(n) is not None and _val(n).dim() == 3 else None
    return None


def weight_chain(w: fx.Node) -> list[fx.Node]:
    """w and the nodes it is a view or cast of, back to a placeholder (last), or [] when a
    step is not an experts-keeping view."""
    chain = [w]
    while w.op == "call_function":
        name = op_name(w)
        if name not in _WEIGHT_VIEWS:
            return []
        tensors = [a for a in w.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        if len(tensors) != 1 or not _keeps_dim0(w, name):
            return []
        w = tensors[0]
        chain.append(w)
    return chain if w.op == "placeholder" else []


def _keeps_dim0(node: fx.Node, name: str) -> bool:
    """Does this view/cast leave dim 0 where it is, whole (dims read from the schema)?"""
    vin, vout = _val(node.all_input_nodes[0]), _val(node)
    if not isinstance(vout, torch.Tensor) or vout.dim() < 1 or vout.shape[0] != vin.shape[0]:
        return False
    if name == "t":
        return vin.dim() < 2
    for arg in _WEIGHT_VIEWS[name]:
        dims = schema_arg(node, arg)
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        if name == "permute":
            if not dims or dims[0] % vin.dim() != 0:
                return False
        elif any(d is None or d % max(vin.dim(), 1) == 0 for d in dims):
            return False
    return True


def schema_arg(node: fx.Node, name: str, default=None):
    """The argument `name` of an ATen op node, read through the op's schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if a.name in node.kwargs:
                return node.kwargs[a.name]
            if i < len(node.args) and not a.kwarg_only:
                return node.args[i]
            return a.default_value if a.has_default_value() else default
    return default


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None
