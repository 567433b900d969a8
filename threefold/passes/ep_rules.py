"""Expert parallelism's region rules: which ops may sit between the expert matmuls of one
expert region (passes/experts.py), one pure function per op on the shared registry
(threefold/ops/rules.Registry, as tp's passes/tp_decisions.py and cp's passes/cp_rules).

A region runs on the experts' ranks, on any subset of its rows, so every op in it must keep
each row's result a function of that row alone, in its place on one dim (dim 0 where the
rows are sorted by expert; a dense region's experts may sit on any). Where the rows go
through an op is the batch-row rules' answer (passes/row_rules.propagate, with the region's
row inputs and expert matmul outputs as the rows); a rule here turns that answer, for one
call, into a decision: `Decision(out=row state)` (the op keeps the rows in place) or
`NoRule(why)` (the op is not row-wise; passes/experts.py makes it a PlanError naming the op).
Rules never touch the graph.

  every op (`row_wise`)       its rows are kept in place, whole, on one dim of every tensor it makes
  `_assert_tensor_metadata`   makes no tensor: only the row state is checked
  ops placing by position     also refused when a position argument is computed from the
  (index ops, embedding,      rows: a global position means nothing on the expert's rank
   nonzero, sort...)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.ops import families as fam
from threefold.ir.program import tf
from threefold.ops.rules import Decision, NoRule, Place, Refused, Registry, refuse
from threefold.passes.row_rules import propagate
from threefold.passes.row_state import LOST, POS, Rows, op_name
from threefold.passes.shard import AxisRules
from threefold.placement import Shard


EP = Registry("ep")


@dataclass(frozen=True, eq=False)
class RegionCall:
    """One op of an expert region as an ep rule sees it (read only)."""
    node: fx.Node
    name: str
    states: dict        # node -> row state of the region's values before it
    rows: int           # the region's rows
    state: object       # the op's output row state (row_rules.propagate)
    reason: str | None  # why the batch-row rules say it mixes rows, or None


def decide(node: fx.Node, states: dict, rows: int) -> tuple:
    """(the op's output row state, why it is not row-wise or None)."""
    state, reason = propagate(node, states, rows)
    call = RegionCall(node, op_name(node), states, rows, state, reason)
    d = EP.decide(call.name, node, call)
    if d is None:
        try:
            d = row_wise(call)
        except Refused as exc:
            d = NoRule(str(exc))
    return state, (d.why if isinstance(d, NoRule) else None)


def row_wise(c: RegionCall) -> Decision:
    """The default: the batch-row rules keep every row in place on one dim of every output."""
    _rows_in_place(c, makes_tensors=True)
    return Decision(out=c.state)


@EP.rule("_assert_tensor_metadata")
def _assert(c: RegionCall) -> Decision:
    """An assertion export leaves on a region value: it makes no tensor."""
    _rows_in_place(c, makes_tensors=False)
    return Decision(out=c.state)


@EP.rule(*sorted(fam.PLACE_BY_POSITION))
def _by_position(c: RegionCall) -> Decision:
    """Refused where a position argument is computed from the rows, else as row_wise."""
    d = row_wise(c)
    if any(c.states.get(a) is not None for a in c.node.all_input_nodes[1:]):
        refuse("it places values by positions computed from the rows")
    return d


def _rows_in_place(c: RegionCall, makes_tensors: bool) -> None:
    if c.reason:
        refuse(c.reason)
    parts = c.state if isinstance(c.state, tuple) else (c.state,)
    if any(p in (LOST, POS) for p in parts):
        refuse("no rule keeps its rows in place")
    if makes_tensors and not _rows_kept(c.node, parts, c.rows):
        refuse("it does not keep the rows whole on one dim")


def _rows_kept(n: fx.Node, parts: tuple, rows: int) -> bool:
    """Every tensor this op makes holds the region's rows whole, one per index, on one dim
    (dim 0 for rows sorted by expert; a dense region's experts may sit on any dim, and the
    region's inputs and outputs are cut there, passes/experts.py)."""
    v = n.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    if not any(isinstance(t, torch.Tensor) for t in vals) or len(parts) != len(vals):
        return False
    return all(isinstance(p, Rows) and p.dim < t.dim() and t.shape[p.dim] == rows
               for p, t in zip(parts, vals) if isinstance(t, torch.Tensor))


# -- the ep axis on the sharding walker (passes/shard.py) ------------------------------------

class ExpertAxis(AxisRules):
    """ep > 1, on each chunk graph once expert regions are found (passes/experts.py): every
    expert weight (its parameter, wherever it is held, and the views a region reads) is S(0)
    on ep, and every value of an expert region S(d) on the dim d that holds its rows: the
    experts (a dense region's, on any dim), or the rows sorted by expert (dim 0)."""
    axis = "ep"
    phase = "chunks"

    def active(self, prog) -> bool:
        return getattr(prog.plan, "ep", 1) > 1 and any(c.experts for c in prog.chunks)

    def prepare(self, w) -> None:
        dims = {name: 0 for r in w.part.experts for name in list(r["weights"]) + list(r["nodes"])}
        for r in w.part.experts:
            dims.update({k: d for k, d in r.get("dims", {}).items() if k in dims and d is not None})
        w.ctx = ({f for c in w.stage.chunks for r in c.experts for f in r["params"]}, dims)

    def seed(self, w, node):
        params, dims = w.ctx
        return 0 if tf(node).get("fqn") in params else dims.get(node.name)

    def decide(self, w, node):
        return Place(w.ctx[1].get(node.name))

    def placement(self, s):
        return Shard(s) if isinstance(s, int) and not isinstance(s, bool) else None


SHARDING = (ExpertAxis(),)
