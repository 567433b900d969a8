"""Context parallelism (plan `cp=N`): the graph traced on this rank's share of each sequence.

The compiler traces at the local sequence length n = S/cp (compiler/api.py cuts the example
batch along the sequence dims passes/seq_dims.py finds), and the runtime feeds each cp rank
blocks r and 2cp-1-r of every sequence (runtime/cp_ops.py). Most ops are then already right:
they treat positions independently. cp's hooks on the sharding walker (passes/shard.py,
`ContextParallel`, named by cp's mesh entry) rewrite the ones that are not and check the rest:

1. Attention becomes ring attention (runtime/cp_ops.ring_attention; passes/cp_attention.py
   finds it): the SDPA op, and the pattern written by hand, matmul(q, k^T) [* or / a constant] [+ mask | masked_fill(mask,
   -inf)]... -> softmax(-1) [-> cast, dropout(p=0)] -> matmul(., v). Masks (passes/cp_masks.py)
   become what the ring recomputes per pair of blocks: a function of j - i (causal, sliding
   window, ALiBi) from global positions, and a key-side padding bias that travels with K/V;
   any other mask is a PlanError.
2. `arange(n)` over the sequence becomes `cp_ops.positions(n)`: this rank's global positions,
   so learned position embeddings and rotary tables see where the tokens really are.
3. Every op is checked by the sequence rules (passes/cp_rules/): position-local ops keep
   the sequence placement; one that mixes positions runs on the all-gathered sequence
   (passes/cp_fallback.py) where its family allows, else is a PlanError naming it.
4. Where such an op reads only input-free values (positions, tables, constants), they are
   computed whole on every rank instead, nothing moved (passes/cp_free_whole.py).
5. A slice that drops positions at an end of the sequence (a shift of the tokens inside the
   model) keeps every rank's positions with a tail that stands for nothing (passes/cp_tails.py).
6. A scan over the whole batch's tokens (an expert capacity queue) runs gathered, and the
   element-wise ops computed from it take the numbers of the model traced at the whole length
   (the capacity one process computes from its token count; passes/cp_counts.py).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.errors import PlanError
from threefold.passes.cp_masks import input_free
from threefold.ops.families import ARANGE_TO_INDEX, args_of
from threefold.passes.cp_attention import erase_dead, readers, rewrite_attention
from threefold.passes.cp_counts import reads_counts, whole_scalars
from threefold.passes.cp_factories import split_factories
from threefold.passes.cp_fallback import gather_around
from threefold.passes.cp_free_whole import FreeWhole, cut_whole_inputs, free_inputs_whole, free_whole_decision, \
    run_free_whole
from threefold.passes.cp_recurrence import collect, finish, step_read
from threefold.passes.cp_shifts import shift_halo
from threefold.passes.cp_padding import PaddedSum, limit_rings, padded_decision, real_length
from threefold.passes.cp_tables import rows_at_positions
from threefold.passes.cp_tails import OnTail, PadShift, Shorten, on_tail, pad_shift, shorten, sum_without_tail, \
    tail_decision, tail_of
from threefold.passes.cp_whole import TWIN, is_whole
from threefold.passes.cp_whole_inputs import GatherWhole, whole_decision, whole_inputs
from threefold.passes.cp_rules import PARTIAL, Gather, Place, Refuse, Seq, decide, op_name
from threefold.passes.cp_rules.core import is_local
from threefold.passes.shard import AxisRules, Fallback
from threefold.placement import P, Shard, on_mesh_of
from threefold.runtime import cp_ops, cp_scan
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


class ContextParallel(AxisRules):
    """cp on the sharding walker (passes/shard.py): the pre-rewrites (1 and 2 above), each
    value's sequence placement from the sequence rules' decisions (3), the all-gather fallback
    as its redistribution, position tables and factories of the local length rewritten where
    a refusal names them."""
    axis = "cp"
    fix = "context parallelism cannot split the sequence here: use cp=1 for this model (or rewrite the op position-wise)"

    def active(self, stage) -> bool:
        return stage.plan.cp > 1

    def prepare(self, w) -> None:
        gm, stage, n = w.gm, w.stage, w.stage.seq_len
        rings = rewrite_attention(gm, stage, n)
        limited = limit_rings(gm, stage)   # an uneven sequence's padded keys hidden (cp_padding.py)
        convs = _causal_convolutions(gm, stage, n)
        moved = _global_positions(gm, n, real_length(stage) if stage.seq_tail else None)
        _drop_unread(gm.graph)   # a mask the model builds and never reads (Qwen2-MoE) is not checked
        w.ctx = {"rings": rings, "convs": convs, "moved": moved, "tables": [], "free": {}, "limited": limited}

    def seed(self, w, node):
        """A user input's sequence dim: its cp entry (compiler/api.py)."""
        d = on_mesh_of(node).dim("cp") if tf(node).get("kind") == "input" else None
        return Seq(d) if d is not None else None

    def decide(self, w, node):
        state = w.state
        if reads_counts(node):   # computed from counts over the whole batch: one process's numbers (cp_counts.py)
            whole_scalars(node, w.stage, w.refusal(node, "reads a count over the whole batch"))
        if any(tail_of(a) for a in node.all_input_nodes):     # a sequence shortened inside the model (cp_tails.py)
            return tail_decision(node, state, None)
        if any(is_whole(a) for a in node.all_input_nodes):   # computed from a grid kept whole (cp_whole.py)
            return whole_decision(node, state, w.stage, w.refusal(node, "mixes sequence positions"))
        stacked = collect(w, node)   # one value per step of a loop, back along the sequence (cp_recurrence.py)
        if stacked is not None:
            return Place(stacked)
        if all(state.get(a) is None for a in node.all_input_nodes) and op_name(node) != "shard_seq":
            return Place(Seq(0) if op_name(node) == "positions" else None)
        d = decide(node, state, w.stage)
        free = free_whole_decision(node, state, d)   # input-free: computed whole, nothing moved (cp_free_whole.py)
        if free is not None:   # a padded sequence's at its real length (cp_padding.real_length)
            return free
        if not isinstance(d, Place) and shift_halo(node, state, w.stage):   # a token shift: a halo exchange
            return None                                                     # (cp_shifts.py places it)
        if isinstance(d, Refuse) and step_read(w, node, d.why):   # a loop's step: its state handed rank to rank
            return Place(None)                                    # at the end of the walk (finish)
        # x[:, :-1], x[:, 1:]: kept at n positions with a tail; a sum over a padded sequence skips the padding
        return tail_decision(node, state, d) or padded_decision(node, state, w.stage, d)

    def redistribute(self, w, node, d, why: str):
        if isinstance(d, Shorten):
            return shorten(node, w.state, w.stage, why)
        if isinstance(d, OnTail):
            return on_tail(node, w.state, w.stage, why)
        if isinstance(d, PadShift):
            return pad_shift(node, w.state, w.stage, why)
        if isinstance(d, PaddedSum):
            return sum_without_tail(node, w.state, w.stage, why), []
        if isinstance(d, FreeWhole):
            try:
                return run_free_whole(node, w.state, w.stage, w.ctx["free"], why)
            except PlanError:
                if not isinstance(d.then, Gather):
                    raise PlanError(why) from None
        if isinstance(d, GatherWhole):
            free_inputs_whole(node, w.state, w.stage, w.ctx["free"])
            cut = cut_whole_inputs(node, w.state, w.stage)   # meets a split value: this rank's blocks, no gather
            if cut is not None:
                return cut, []
            return whole_inputs(node, w.state, w.stage, why)
        return gather_around(node, w.state, w.stage, why, op_name(node), Seq)

    def fallback(self, w, node, moved: int, why: str) -> Fallback:
        return Fallback("cp", op_name(node), node.name, tf(node).get("module") or "<top>",
                        2 * w.stage.plan.microbatches * moved, "mixes sequence positions",
                        "the sequence is all-gathered around it",
                        "all-gather forward, reduce-scatter backward; strict=true refuses it")

    def retry(self, w, node, d) -> list:
        """A position table or factory of the local length that a refusal names: this rank's rows."""
        moved = rows_at_positions(d.table, w.stage) or split_factories(d.table, w.state, w.stage)
        w.ctx["tables"].extend(m for m in moved if op_name(m) == "index_select")
        return moved

    def check_output(self, w, node):
        finish(w)   # the loops over time steps the walk met: rewritten, or the PlanError naming why not
        for out in node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]:
            if w.stage.has_loss and isinstance(w.state.get(out), Seq):
                return "the loss is not reduced over the sequence"
            if is_local(w.state.get(out)):
                return "returns rows sorted on this rank (a routing sort) or counted on it"
            if is_whole(out):
                return "returns a grid of positions computed whole on every rank (attention weights?)"
            if tail_of(out):
                return "returns a sequence shortened inside the model (x[:, :-1]): return it whole, or shorten it outside"
        return None

    def placement(self, s):
        """S(d) along the sequence (a flattened [b*s, h] dim counts), P for a sum over this rank's tokens."""
        if isinstance(s, Seq):
            return Shard(s.dim)
        return P if s == PARTIAL else None

    def summary(self, w) -> tuple:
        stage, c = w.stage, w.ctx
        names = sorted({tf(t.args[0]).get("fqn") for t in c["tables"] if tf(t.args[0]).get("fqn")})
        return (f"cp={stage.plan.cp}: {c['rings']} attention op(s) run as ring attention over the cp group; "
                f"{c['moved']} sequence arange(s) give global positions; {len(c['tables'])} position table(s) sliced "
                f"to the sequence read this rank's rows{' (' + ', '.join(f'`{x}`' for x in names) + ')' if names else ''}; "
                f"{c['convs']} causal conv1d(s) exchange halos; "
                f"{_count(w.gm, cp_scan.scan_seq)} scan(s) along the sequence carry the blocks before theirs "
                "(all-gathered totals, 2 positions per rank); "
                f"{_loops(w)}"
                f"{_padding(w)}"
                "sequence split in blocks r, 2cp-1-r",)


SHARDING = (ContextParallel(),)


def _padding(w) -> str:
    stage = w.stage
    if not stage.seq_tail:
        return ""
    whole = stage.seq_len * stage.plan.cp
    return (f"the sequence of {whole - stage.seq_tail} positions padded to {whole} ({stage.seq_tail} position(s) "
            f"standing for nothing: {stage.seq_tail / (whole - stage.seq_tail):.1%} more tokens per rank; "
            f"{w.ctx.get('limited', 0)} non-causal attention(s) hide the padded keys); ")


def _loops(w) -> str:
    loops = w.ctx.get("recur")
    if not loops or not loops.count:
        return ""
    return (f"{loops.count} loop(s) over time steps hand their state rank to rank ({sum(loops.handed)} state "
            "element(s) per microbatch; each block waits for the one before it on the neighbouring rank: sequential "
            "across the ranks, not overlapped); ")


def _count(gm: fx.GraphModule, target) -> int:
    return sum(node.target is target for node in gm.graph.nodes)


def _drop_unread(graph: fx.Graph) -> None:
    """Erase values nothing reads (but metadata asserts): pure calls only, last first."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or op_name(node) == "_assert_tensor_metadata" or node.is_impure():
            continue
        users = list(node.users)
        if all(op_name(u) == "_assert_tensor_metadata" and not u.users for u in users):
            for u in users:
                graph.erase_node(u)
            graph.erase_node(node)


__all__ = ["ContextParallel", "SHARDING"]


# -- attention -----------------------------------------------------------------------------


_INDEX_VIEWS = ARANGE_TO_INDEX


def _indexes_an_input(arange: fx.Node) -> bool:
    """The arange only indexes values that come from inputs (through views and + 0), as HF's
    mask[batch_idx, kv_idx]: there it is the local identity, since the input holds this
    rank's positions already; cp_rules checks the index op."""
    stack, seen, found = [arange], set(), False
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in seen or op_name(u) == "_assert_tensor_metadata":
                continue
            seen.add(u)
            name = op_name(u)
            if name == "index" and u.args[0] is not x and not input_free(u.args[0]):
                found = True
            elif name in _INDEX_VIEWS and (name not in ("add", "sub") or u.args[1] == 0):
                stack.append(u)
            else:
                return False
    return found


def _numbers_rows(arange: fx.Node) -> bool:
    """The arange only numbers rows put at permuted places (inverse[perm] = arange(m), a
    routing sort's inverse): row numbers on this rank, not positions (cp_rules/permutations)."""
    users = readers(arange)
    return bool(users) and all(op_name(u) in ("index_put", "index_put_") and args_of(u)["values"] is arange
                               and args_of(u)["self"] is not arange for u in users)


# -- causal convolutions ----------------------------------------------------------------------

def _causal_convolutions(gm: fx.GraphModule, stage, n: int) -> int:
    """conv1d(x, w, b, stride 1, padding k-1, dilation 1, groups) -> slice(time, 0, n): the
    causal convolution of a Mamba-style block -> cp_ops.causal_conv1d, which fetches the k-1
    positions before each block from the rank that holds them (a halo exchange)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or op_name(node) != "conv1d":
            continue
        a = args_of(node)
        x, w = a["input"], a["weight"]
        k = w.meta["val"].shape[-1]
        users = readers(node)
        cut = users[0] if len(users) == 1 and op_name(users[0]) == "slice" else None
        if (list(a["stride"]) != [1] or list(a["dilation"]) != [1] or not isinstance(a["padding"], (list, tuple))
                or list(a["padding"]) != [k - 1] or x.meta["val"].shape[-1] != n or cut is None):
            continue   # not the causal form: cp_rules refuses it
        dim, start, end = (list(cut.args[1:4]) + [None, None, None])[:3]
        if dim % cut.meta["val"].dim() != cut.meta["val"].dim() - 1 or start not in (0, None) or end != n:
            continue
        if k - 1 > n // 2:
            raise PlanError(f"cp={stage.plan.cp}: conv1d at {tf(node).get('module') or '<top>'} reaches {k - 1} "
                            f"positions back, more than a block ({n // 2}); use a smaller cp or cp=1")
        with gm.graph.inserting_before(node):
            conv = gm.graph.call_function(cp_ops.causal_conv1d, (x, w, a["bias"], a["groups"], CP),
                                          {"ranks": stage.plan.cp})
        conv.meta = dict(cut.meta)
        conv.meta["tf"] = dict(tf(node))
        cut.replace_all_uses_with(conv)
        erase_dead([cut, node], gm.graph)
        count += 1
    return count


# -- positions -------------------------------------------------------------------------------

def _global_positions(gm: fx.GraphModule, n: int, limit: int | None = None) -> int:
    """arange(n) / arange(0, n[, 1]) over the sequence -> this rank's global positions (`limit`:
    the real length of a padded sequence, the padded positions read as limit - 1)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or op_name(node) != "arange":
            continue
        overload = node.target._overloadname
        args = list(node.args)
        if overload == "default":
            start, end, step = 0, args[0], 1
        elif overload == "start":
            start, end, step = args[0], args[1], 1
        elif overload == "start_step":
            start, end, step = args[0], args[1], args[2]
        else:
            continue
        if (start, end, step) != (0, n, 1) or _indexes_an_input(node) \
                or _numbers_rows(node):
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "device")}
        if limit is not None:
            kwargs["limit"] = limit
        with gm.graph.inserting_before(node):
            pos = gm.graph.call_function(cp_ops.positions, (n, CP), kwargs)
        pos.meta = dict(node.meta)
        pos.meta["tf"] = dict(tf(node))
        pos.meta[TWIN] = node.name   # the arange it stands for (cp_free_whole reads its twin)
        node.replace_all_uses_with(pos)
        gm.graph.erase_node(node)
        count += 1
    return count
