"""Regions of forward under `torch.autocast`, as torch.export leaves them (a higher-order op
wrapping the region's body), made plain graph nodes with autocast's dtype casts explicit.

torch.export's training IR records a region's ops as written (`linear` of fp32 operands),
with each node's `val` meta computed under the region's autocast (`linear`'s output is
bf16). Autocast's rule for one op is a cast of its floating-point tensor operands to one
dtype (the lower-precision dtype for matmul-like ops, fp32 for ops it keeps fp32, the widest
for ops it promotes), the op then running as usual. So a node whose traced output dtype
differs from an operand's dtype gets that operand cast to the output's dtype: the op sees
what it saw under autocast and makes the same values, and every later pass sees ordinary
`_to_copy` nodes. An `enabled=False` region (a library keeping a block fp32) needs nothing:
its ops run as written.

The higher-order ops' arguments are read by name from their call signatures.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ops.families import DTYPE_SETTERS, op_name

GRAD_HOP = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
AUTOCAST_HOP = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def hop_arguments(node: fx.Node) -> dict:
    """The wrapper's arguments by name: enable_grad / device_type, dtype, enabled,
    cache_enabled, then wrapped_func and args (the region's operands)."""
    signature = inspect.signature(type(node.target).__call__)
    try:
        bound = signature.bind(None, *node.args, **node.kwargs)
    except TypeError as exc:
        raise PlanError(f"cannot read the arguments of {node.target} at {node.name} ({exc}); "
                        "this torch version's higher-order op is not one threefold knows") from None
    return {k: v for k, v in bound.arguments.items() if k != "self"}


def mark_region(nodes: list[fx.Node], args: dict) -> None:
    """Record on each copied node the autocast state it ran under (the innermost region's:
    an inner region's nodes are copied again, later, and marked again)."""
    state = {"device_type": args["device_type"], "dtype": args["dtype"], "enabled": bool(args["enabled"])}
    for n in nodes:
        if n.op == "call_function":
            n.meta["threefold_autocast"] = state


def make_casts_explicit(graph: fx.Graph) -> int:
    """Insert autocast's casts before each node traced under an enabled autocast region.
    Returns the number of casts inserted."""
    inserted = 0
    for node in list(graph.nodes):
        state = node.meta.pop("threefold_autocast", None)
        if state is None or not state["enabled"] or op_name(node) in DTYPE_SETTERS:
            continue
        dtype = _floating_output_dtype(node)
        if dtype is None:
            continue
        for operand in node.all_input_nodes:
            val = operand.meta.get("val")
            if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point or val.dtype == dtype:
                continue
            with graph.inserting_before(node):
                cast = graph.call_function(torch.ops.aten._to_copy.default, (operand,), {"dtype": dtype})
            cast.meta["val"] = val.to(dtype)
            cast.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            if "stack_trace" in node.meta:
                cast.meta["stack_trace"] = node.meta["stack_trace"]
            node.replace_input_with(operand, cast)
            inserted += 1
    return inserted


def disabled_region_ops(graph: fx.Graph) -> list[fx.Node]:
    """Nodes traced under an `enabled=False` region (before make_casts_explicit drops the marks)."""
    return [n for n in graph.nodes if n.meta.get("threefold_autocast", {}).get("enabled") is False
            and op_name(n) not in DTYPE_SETTERS]


def _floating_output_dtype(node: fx.Node):
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    dtypes = {v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
    return dtypes.pop() if len(dtypes) == 1 else None
