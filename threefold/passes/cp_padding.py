"""Sequences of a length 2*cp does not divide, under cp (plan `cp=N`).

The load-balanced layout cuts each sequence into 2cp equal blocks. A sequence of S positions
is padded at the end to S' = ceil(S / 2cp) * 2cp (runtime/cp_ops.pad_to_blocks, the one
function both the compiler's trace and the runtime's cut call) and traced at S'/cp; the last
S' - S positions of the whole sequence stand for nothing: the stage's `seq_tail`, the same
notion as the tail a shift inside the model leaves (passes/cp_tails.py), but here it starts
at the inputs, so every value along the sequence carries it. Position-wise ops are exact as
they are (a padded position only ever feeds itself). What mixes positions is made exact:

* causal attention (SDPA is_causal, a causal mask the ring fits, passes/cp_masks.py): the
  padded keys come after every real query, so causality already hides them from the real
  queries; nothing to do;
* non-causal attention (an encoder): the ring gets `limit=S`, keys at global positions >= S
  are hidden from every query (cp_ops._step_bias), forward and backward;
* a sum over the sequence (the loss's numerator, a sum pooling): cp_tail.drop_tail zeroes
  the padded positions first (cp_tails.sum_without_tail); a mean loss over elements, whose
  count was traced at the padded length, has its numerator scaled by S'/S, so that divided by
  the traced count it is the mean over the real ones; a count computed from the inputs (the
  labels that are not ignored) is evaluated on the whole unpadded sequences
  (passes/cp_denominator.py);
* what the all-gather fallback runs (a mean or softmax over the sequence, a sort, a
  convolution, a BatchNorm over every token of the batch merged [b*s]): gathered (through its
  digits where merged), cut to the S real positions, run as one process runs it, and where its
  output runs along the sequence, padded back and cut to this rank's blocks
  (cp_gather.gather_seq `tail=` / shard_seq); scans forward along the sequence (cumsum) carry
  the blocks before theirs and the padding comes last: exact as they are;
* position tables: `arange` over the sequence reads the padded positions as S - 1
  (cp_ops.positions `limit=`), so a table of exactly S rows is never read past its end; a
  mask is fitted from the model traced at S (passes/cp_masks.py), so a causal-mask buffer of
  exactly S rows is read within it;
* token shifts: a look-ahead (x[i + k]) near the real end reads zeros as one process does, not
  the padding (a drop_tail after its halo, passes/cp_shifts.py); Hugging Face's label shift
  fills from the real end (cp_tail.shift_fill `tail=`); a shift inside the model adds its tail
  to the padding (cp_tails.py);
* values computed whole on every rank (a grid of positions, cp_whole.py; an input-free value
  rebuilt whole, cp_free_whole.py): computed at the real length S, exactly as one process does
  (`real_length`): the gathered inputs leave the padding out, positions become arange(S), a
  factory made at S' is narrowed to S, a view's shape grows from n to S (not n*cp), and the
  model's twin is read from its trace at S (stage.retrace); where a whole value meets the split
  sequence, shard_seq pads it back before it cuts this rank's blocks;
* a step on another length than the compiled one is an error naming both (the manifest's
  `seq_length`, runtime/engine.py): 7 and 6 tokens both pad to 8 at cp=2.

Refused in one line (PlanError naming the op): a scan or sort over the tokens of the whole batch
compared with counts traced at the padded length (cp_counts.py), a loss denominator that cannot run on the unpadded sequences, and the
sequence made inside the model.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.ops.rules import Gather, Place
from threefold.passes.cp_rules.core import PARTIAL, Seq
from threefold.runtime import cp_ops


class PaddedSum(Gather):
    """A sum over the padded sequence (a PARTIAL decision): its padded positions zeroed first."""


def real_length(stage) -> int:
    """S: the whole sequence without its padding."""
    return stage.seq_len * stage.plan.cp - stage.seq_tail


def padded(stage) -> bool:
    return bool(getattr(stage, "seq_tail", 0)) and stage.plan.cp > 1


def padded_decision(node: fx.Node, state: dict, stage, d):
    """PaddedSum where `d` sums a value along the padded sequence, else d."""
    if not padded(stage) or not isinstance(d, Place):
        return d
    outs = d.out if isinstance(d.out, tuple) else (d.out,)
    if PARTIAL in outs and any(isinstance(state.get(a), Seq) for a in node.all_input_nodes):
        return PaddedSum("sums over a padded sequence")
    return d


def limit_rings(gm: fx.GraphModule, stage) -> int:
    """Every non-causal ring attention hides the padded keys (`limit=S`): a padded key never
    contributes to a real query. A causal one (`causal`: its mask hides at least the future)
    needs nothing: the padded keys sit after every real query. Returns how many were limited."""
    if not padded(stage):
        return 0
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is cp_ops.ring_attention and not node.args[4]:
            node.kwargs = {**node.kwargs, "limit": real_length(stage)}
            count += 1
    return count


def scale_mean(node: fx.Node, stage, state: dict) -> None:
    """The loss's numerator of a mean over elements (loss_form: a const denominator, the count
    traced at the padded length): times S'/S, so that over the traced count it is the mean over
    the real elements (the padded ones were zeroed by drop_tail)."""
    whole = stage.seq_len * stage.plan.cp
    graph = node.graph
    with graph.inserting_after(node):
        m = graph.call_function(torch.ops.aten.mul.Tensor, (node, whole / real_length(stage)))
    m.meta = {"val": node.meta["val"], "tf": dict(tf(node))}
    node.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
    state[m] = PARTIAL
