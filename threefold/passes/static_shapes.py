"""Refuse data-dependent shapes with one line, before any pass reads a shape.

torch.export keeps an op whose output size depends on tensor values (nonzero, a one-argument
torch.where, masked_select, unique) with an unbacked size `u0`. Every later pass (costs,
pipeline cuts, codegen's shape comments, the boundary specs) needs concrete sizes, so such a
graph used to fail deep inside a pass with a traceback. The common case is an MoE block that
loops over its experts and picks each one's tokens with torch.where; the fix is the grouped
form (tokens sorted by expert, one stacked weight per projection, a grouped matmul), which
transformers 5.x uses and which expert parallelism (plan ep=N) finds.
"""
from __future__ import annotations

import torch

from threefold.ir.contracts import stage_pass
from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.ir.stages import Traced
from threefold.errors import PlanError


@stage_pass(needs=Traced)
def check_static_shapes(prog: Traced) -> Traced:
    """Needs: a traced graph. Guarantees: every value's shape is a plain integer tuple."""
    for node in prog.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
                src = _producer(node)
                if src.op == "placeholder":
                    continue   # an input the tracer left symbolic (an eager loss's target): not data
                where = tf(src).get("module", "") or "<top>"
                raise PlanError(f"{prog.name}: {op_name(src)} in {where} makes a tensor whose size depends on "
                                "the data (e.g. torch.where(mask) or nonzero picking each expert's tokens); threefold "
                                "needs static shapes: compute such a block densely or in the grouped form (tokens "
                                "sorted by expert, stacked expert weights, a grouped matmul)")
    return prog


def _producer(node):
    """The first op upstream whose output size is data-dependent while its inputs' are not."""
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        vals = v if isinstance(v, (tuple, list)) else [v]
        if any(isinstance(t, torch.Tensor) and any(not isinstance(s, int) for s in t.shape) for t in vals):
            return _producer(a)
    return node
