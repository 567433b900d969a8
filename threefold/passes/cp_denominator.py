"""The loss's denominator under cp (plan `cp=N`): on whole sequences where it slices them.

A loss's denominator computed from the inputs (passes/loss_form.py: the number of labels that
are not ignored) is evaluated by the runtime on each batch rank's share of the inputs and
summed. Under cp a share is this rank's blocks of each sequence: the sum over the cp ranks is
the whole sequence's count only where the graph treats positions one by one. Where it moves
them (the labels a model shifts itself, `x[:, 1:]`: the last position of each block would count
and the first of the next not), the runtime evaluates it on whole sequences instead, once per
dp rank (`whole_along`; runtime/engine.py), as one process does.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ops.families import MOVING_FAMILIES, family
from threefold.placement import on_mesh_of


def whole_along(denominator: fx.GraphModule | None, graph: fx.Graph, plan, tail: int = 0) -> list:
    """["cp"] where the denominator graph moves positions of an input cp splits, or where the
    sequence is padded (`tail` positions at its end, passes/cp_padding.py: a count over a rank's
    padded share would count the padding), else []."""
    if denominator is None or getattr(plan, "cp", 1) == 1:
        return []
    dims = {p.name: on_mesh_of(p).dim("cp") for p in graph.nodes if p.op == "placeholder"}
    ins = [p for p in denominator.graph.nodes if p.op == "placeholder"]
    if not any(dims.get(p.name) is not None for p in ins):
        return []
    if not tail and not any(x.op == "call_function" and family(x) in MOVING_FAMILIES for x in denominator.graph.nodes):
        return []
    vals = []
    for p in ins:   # it must run on whole sequences: each cut input as cp copies of its share, unpadded
        v, d = p.meta.get("val"), dims.get(p.name)
        if isinstance(v, torch.Tensor) and d is not None:
            v = torch.cat([v] * plan.cp, dim=d)
            v = v.narrow(d, 0, v.shape[d] - tail)
        vals.append(v)
    try:
        with torch.no_grad():
            denominator(*vals)
    except Exception as exc:
        if tail:
            raise PlanError(f"cp={plan.cp}: the loss's denominator is counted on the whole unpadded sequences of an "
                            f"uneven length and cannot run there ({type(exc).__name__}); use a sequence length that "
                            f"is a multiple of {2 * plan.cp}, or cp=1") from None
        raise PlanError(f"cp={plan.cp}: the loss's denominator moves sequence positions (a shift of the labels "
                        f"inside the model?) and cannot be computed on whole sequences ({type(exc).__name__}); "
                        "shift the labels in the data, or use cp=1") from None
    return ["cp"]
