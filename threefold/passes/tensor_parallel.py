"""Megatron tensor parallelism derived from an unmodified ATen graph.

Every value gets a placement (tp_placement.py): Replicate, Partial or Shard(dim). We walk
the graph once in order, writing a new graph of *local* (per-tp-rank) shapes:

* A matmul with a parameter weight (aten.linear, GPT-2's addmm with an [in, out] Conv1D
  weight, mm/matmul) whose input is replicated becomes column-parallel: its weight is split
  on the output features, the input passes through f (identity forward, all-reduce
  backward; one f per input value, shared by q/k/v or gate/up). If its output feeds a
  split (a fused QKV), the weight is split block-wise so each rank gets its own q, k, v.
* A weight matmul whose input is sharded on the contracted dim becomes row-parallel: its
  output is Partial and is reduced at once by g (all-reduce forward, identity backward),
  or under sequence parallelism by a reduce-scatter; the bias is added after.
* Everything in between follows pure per-op (or per-family) rules registered on
  tp_decisions.REGISTRY (tp_rules*.py: elementwise, views and reshapes by dimension maps
  (tp_dims.py), splits and slices of block-strided dims, attention matmuls, softmax,
  norms ...). A rule returns a decision; this pass applies it (`apply`): inputs brought to
  the placements it needs by one redistribution step (tp_redistribute.py), the op or its
  substitute emitted, the output's placement recorded. Where no rule applies, the op runs
  on gathered inputs, recorded in prog.tp_report and a PlanError under strict=true.
* A column-parallel projection whose shards reach such an op is instead kept whole (the
  pass reruns with it replicated): Megatron's pairing, column then row, is only used where
  it pays. One whose heads or output features tp does not divide is padded to whole heads
  (tp_padding.py); a fused projection read as slices is one linear per piece, and a piece
  that cannot be split (one k/v head) is kept whole beside its sharded siblings
  (tp_fused_split.py, tp_pieces.py).
* `x @ W.T` (matmul of a transposed 2-D parameter) is a weight matmul like aten.linear.
* An embedding indexed by user input (token ids) is vocab-parallel; a cross-entropy over
  vocab-sharded logits becomes the vocab-parallel cross-entropy. Vocabularies t does not
  divide are padded (padding never wins the softmax and gets no gradient).
* Sequence parallelism (plan.sp): replicated activations of [batch, seq, hidden] are kept
  as sequence shards; all-gather before column-parallel matmuls, reduce-scatter after
  row-parallel ones; parameters applied to shards get their gradients summed over tp.
Weights are cut from the full model's tensors by prog.shard_fns, so tp=1 and tp=t start
identical.

The walk is the sharding walker's (passes/shard.py, its local phase): `TensorParallel` below
is tp's AxisRules. `decide` reads the rewrite's state and returns a decision (a rule's, a
weight matmul's with the parameter cuts it needs, or Gather); `write` writes it into the new
graph (`_Rewriter.apply`: the cuts checked, inputs brought by one redistribution step, the
op and its follow-ups emitted), `redistribute` runs a call on gathered inputs, and `again`
walks once more with the projections to keep whole.
"""
from __future__ import annotations


import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.ir.stages import copy_graph_module
from threefold.passes.shard import AxisRules, Fallback, Gather, shard_local
from threefold.passes.tp_fused_split import fused_cuts, split_fused_outputs
from threefold.passes.tp_placement import to_meta
from threefold.passes.tp_redistribute import GATHERS, NoRule, fallback
from threefold.passes.tp_report import report_notes
from threefold.passes.tp_rewrite import _Rewriter

# how many walks tp may take to find the projections to keep whole (`TensorParallel.again`)
_MAX_RETRIES = 8


class TensorParallel(AxisRules):
    """tp's hooks for the sharding walker's local phase (passes/shard.py)."""
    axis = "tp"
    phase = "local"
    fix = "use tp=1 for this model or restructure it"

    def active(self, stage) -> bool:
        return stage.plan.tp > 1

    def prepare(self, w) -> None:
        prog = w.stage
        if w.attempt == 0:
            # a fused projection cut into pieces by slices (Falcon's multi-query qkv) becomes
            # one linear per piece of its weight, on a copy of the graph (tp_fused_split.py)
            if fused_cuts(prog.gm.graph, prog.state):
                prog.gm = copy_graph_module(prog.gm)
                split_fused_outputs(prog.gm.graph, prog.state)
                prog.gm.recompile()
        w.gm = prog.gm
        w.ctx = _Rewriter(prog, w.carry)
        w.ctx.fallbacks = w.fallbacks

    def seed(self, w, old: fx.Node):
        return w.ctx.placeholder(old)

    def decide(self, w, old: fx.Node):
        """None: the call as it is; a TpDecision; Gather(why): run on gathered inputs."""
        rw = w.ctx
        rw.current = old
        if any(a in rw.user_derived for a in old.all_input_nodes):
            rw.user_derived.add(old)
        try:
            return rw.decision(old)
        except NoRule as exc:   # a weight matmul that cannot be split (a reused weight split another way)
            return Gather(str(exc).split(": ", 1)[-1])

    def write(self, w, old: fx.Node, d):
        rw = w.ctx
        mark = len(rw.new.nodes)
        if d is None:   # every input plainly replicated: the call as it is
            rw._note_param_uses(old, sharded=False)
            return rw.bind(old, rw.copy_node(old, val=to_meta(old.meta.get("val"))), mark)
        decided, uses = dict(rw.decisions), (set(rw.shard_uses), set(rw.replicated_uses), len(rw.whole_sites))
        try:
            new = rw.apply(old, d)
        except NoRule as exc:   # an input it cannot bring to the placement asked for
            rw._rollback(mark, decided)
            rw.shard_uses, rw.replicated_uses = uses[:2]
            del rw.whole_sites[uses[2]:]
            return Gather(str(exc).split(": ", 1)[-1])
        return rw.bind(old, new, mark)

    def redistribute(self, w, old: fx.Node, d: Gather, why: str):
        rw = w.ctx
        mark = len(rw.new.nodes)
        new, moved = fallback(rw, old, d.why)
        return rw.bind(old, new, mark), [moved]

    def fallback(self, w, old: fx.Node, moved: int, why: str) -> Fallback:
        return Fallback("tp", op_name(old), old.name, tf(old).get("module", "") or "<top>",
                        moved * w.stage.plan.microbatches, why.split("; use tp=1")[0], GATHERS)

    def write_output(self, w, node: fx.Node) -> None:
        w.ctx._output(node)
        w.ctx._finish()

    def again(self, w, error):
        """Megatron's pairing: a column-parallel matmul pays off only if its shards reach a
        row-parallel matmul (or another sharded consumer). When its shards ran into an op
        with no sharded rule, walk again with that projection replicated instead of
        gathering them; padded heads/features (tp_padding.py) whose shards no rule could
        follow are kept whole, as before padding existed."""
        rw, avoid = w.ctx, dict(w.carry or {})
        last = w.stage.plan.strict or w.attempt >= _MAX_RETRIES - 1
        if error is not None:
            if not rw.padded or last:
                return None
            why = str(error).splitlines()[0]   # whole: inspect shows every note uncut
            avoid.update({fqn: f"its padded shards could not be followed ({why})" for fqn in rw.padded})
            return avoid
        more = {fqn: why for fqn, why in rw.blamed.items() if fqn not in avoid}
        if not more or last:
            return None
        avoid.update(more)
        return avoid

    def commit(self, w) -> None:
        w.ctx.commit()

    def summary(self, w) -> tuple:
        return tuple(w.ctx.notes) + tuple(report_notes(w.stage.tp_report))


SHARDING = (TensorParallel(),)

# the pass under its old name (the planner's trial degrees run it): the walker's local phase
tensor_parallel = shard_local


__all__ = ["SHARDING", "TensorParallel", "tensor_parallel"]
