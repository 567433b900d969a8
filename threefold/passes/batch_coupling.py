"""Refuse what a split batch cannot compute exactly: ops that mix the rows of the batch.

With m*dp > 1 every microbatch (on every dp rank) runs the graph on its own rows. That
equals one process only where each output row depends on its own input rows, up to the
loss's final reduction, which `loss_form` combines exactly from its numerator and
denominator. So we follow the rows through the graph (passes/row_rules.py: per op, where
the batch dim goes and whether the op mixes rows: a reduction, scan, sort or contraction
over it, an all-pairs product, a pick of rows by position or value, a batch statistic):

  * a mixing op before the loss's final reduction whose result reaches the loss is a
    one-line PlanError naming the op, its module and the fixes (m=1 and dp=1, or
    loss=microbatch_mean to accept per-microbatch results; then a note lists them);
  * a training-mode batch statistic (BatchNorm) is the same rule with its own opt-in,
    batchnorm=local (per-microbatch statistics, noted);
  * a buffer written in forward: from values that do not depend on the batch (a step
    counter) it is updated once per step: its placeholder is marked `once_per_step` and
    the generated forward starts every microbatch from the buffer's value at the start of
    the step, so each microbatch computes the same update (runtime/module.step_start);
    written from the batch it is a PlanError (it would see one microbatch's rows).

Values the rules lose track of (an op with no rule whose output has no dim of the rows'
length) are not checked further: the check refuses what it can prove mixes rows and never
guesses about the rest.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.ops import families as fam
from threefold.ir.program import tf
from threefold.ir.stages import Traced
from threefold.errors import PlanError
from threefold.passes.expert_match import expert_matmul
from threefold.passes.loss_form import exact_reductions, final_op, split_fix
from threefold.passes.row_rules import BATCH_STAT_OPS, propagate
from threefold.passes.row_state import LOST, Rows, op_name

# a buffer written through a view of it (or through a pick of a written tuple) is written
_VIEWS = fam.ALIASING | fam.PICKS


def row_states(graph: fx.Graph, batch_dims: list, rows: int) -> tuple[dict, list]:
    """Every node's row state (row_rules), and the ops that mix rows: [(node, reason)]."""
    states: dict[fx.Node, object] = {}
    mixing: list[tuple[fx.Node, str]] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            ann = tf(node)
            d = batch_dims[ann["input_index"]] if ann.get("kind") == "input" and \
                ann["input_index"] < len(batch_dims) else None
            states[node] = Rows(d, 1) if d is not None else None
        elif node.op == "call_function":
            try:
                state, reason = propagate(node, states, rows)
            except Exception:   # a rule that cannot read this node's arguments: stop tracking
                state, reason = LOST, None
            states[node] = state
            if reason:
                mixing.append((node, reason))
    return states, mixing


@stage_pass(needs=Traced)
def check_batch_coupling(prog: Traced) -> Traced:
    """Needs: a traced graph with its inputs' batch dims. Guarantees: with m*dp > 1, no op
    before the loss's final reduction mixes batch rows (or the plan opted in, noted), and
    buffers written in forward without reading the batch are marked once_per_step."""
    parts = prog.plan.dp * prog.plan.microbatches
    if parts == 1 or not prog.batch_dims or not prog.micro_rows:
        return prog
    states, mixing = row_states(prog.graph, prog.batch_dims, prog.micro_rows)
    notes: list[str] = []
    stat_modules = {_where(n) for n, r in mixing if r == "batch statistics"}
    for node, reason in mixing:
        if reason == "batch statistics":
            notes += _batch_statistics(prog, node, parts)
    once = _buffer_writes(prog, states, parts, stat_modules, notes)   # its error names the buffer
    exempt = exact_reductions(prog.graph) if prog.has_loss else set()
    live = _reaches_output(prog.graph)
    for node, reason in mixing:
        if reason == "batch statistics" or node in exempt or node not in live:
            continue
        where, op = _where(node), f"aten.{op_name(node)}"
        if prog.plan.loss == "microbatch_mean":
            notes.append(f"loss=microbatch_mean: {op} in module {where!r} mixes batch rows ({reason}) "
                         "only within each microbatch")
            continue
        raise PlanError(f"{prog.name}: {op} in module {where!r} mixes the rows of the batch ({reason})"
                        f"{_before_loss(prog)}, so the m*dp={parts} microbatch/dp parts cannot equal the "
                        f"whole batch; {split_fix(prog.plan)}")
    notes = [n for i, n in enumerate(notes) if n not in notes[:i] and n not in prog.notes]
    if not once:
        return prog.noted(*notes)
    draft = prog.draft()
    for node in draft.graph.nodes:
        if node.op == "placeholder" and tf(node).get("fqn") in once:
            tf(node)["once_per_step"] = True
    draft.notes.extend(notes)
    draft.notes.append("buffers written in forward from no batch data, updated once per step: "
                       + ", ".join(sorted(once)))
    return draft.freeze()


def _batch_statistics(prog: Traced, node: fx.Node, parts: int) -> list[str]:
    name = op_name(node)
    where = _where(node)
    if prog.plan.batchnorm == "local":
        return [f"batchnorm=local: {where} ({name}) uses per-microbatch batch statistics "
                f"({parts} microbatches x dp ranks), not the global batch's"]
    raise PlanError(f"{prog.name}: module {where!r} (aten.{name}) computes batch statistics in "
                    f"training mode, which with m*dp={parts} would be per microbatch, not over the "
                    "global batch; use m=1 and dp=1, put the module in eval mode, or set "
                    "batchnorm=local in the plan to accept per-microbatch statistics")


def _before_loss(prog: Traced) -> str:
    if not prog.has_loss:
        return ""
    last, _ = final_op(prog.graph)
    if last in exact_reductions(prog.graph):
        return " before the loss's final reduction"
    return f" and the loss ends with aten.{op_name(last)}, not a sum or mean over rows"


def _buffer_writes(prog: Traced, states: dict, parts: int, stat_modules: set,
                   notes: list) -> set[str]:
    """Buffers written in place in forward: the FQNs to update once per step (their new
    value reads no batch data); a PlanError for one written from the batch."""
    root: dict[fx.Node, fx.Node] = {}
    once: set[str] = set()
    for node in prog.graph.nodes:
        if node.op == "placeholder" and tf(node).get("kind") == "buffer":
            root[node] = node
            continue
        if node.op != "call_function" or not node.args:
            continue
        name = op_name(node)
        if name in _VIEWS and node.args[0] in root:
            root[node] = root[node.args[0]]
        schema = getattr(node.target, "_schema", None)
        if node.target is operator.getitem or schema is None or not schema.is_mutable:
            continue
        written = []
        for i, a in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write and value in root:
                written.append(root[value])
        if not written:
            continue
        root[node] = written[0]
        if name in BATCH_STAT_OPS or _where(node) in stat_modules:
            continue   # a BatchNorm's running statistics and counter: the batch-statistics rule
        reads = [a for a in node.all_input_nodes if root.get(a) not in written]
        fqn = tf(written[0])["fqn"]
        if any(states.get(a) is not None for a in reads):
            if prog.plan.loss == "microbatch_mean":
                notes.append(f"loss=microbatch_mean: buffer {fqn!r} is updated from each microbatch's rows")
                continue
            raise PlanError(f"{prog.name}: buffer {fqn!r} is written in forward from the batch "
                            f"(aten.{name} in module {_where(node)!r}), so with m*dp={parts} it would be "
                            f"updated from each microbatch's rows, not once from the whole batch; use m=1 "
                            f"and dp=1, compute the update outside forward, or set loss=microbatch_mean to "
                            f"accept per-microbatch updates")
        once.add(fqn)
    return once


def _reaches_output(graph: fx.Graph) -> set[fx.Node]:
    """Nodes the graph's output depends on (mixing that feeds only a buffer write is the
    buffer rule's concern; dead values concern nobody)."""
    out = next(n for n in graph.nodes if n.op == "output")
    seen: set[fx.Node] = set()
    stack = list(out.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(_value_inputs(n))
    return seen


def _value_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs a node's values depend on row by row. A grouped (expert) matmul's offsets
    only say where each group's rows end in rows sorted by group within the same microbatch:
    counts over all rows feed them, yet every output row is its own row times its group's
    weight, so counting them per microbatch changes no row."""
    m = expert_matmul(node)
    if m is None and op_name(node) in fam.GROUPED_MATMULS:
        offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
        return [a for a in node.all_input_nodes if a is not offs]
    return [a for a in node.all_input_nodes if m is None or a is not m[3]]


def _where(node: fx.Node) -> str:
    return tf(node).get("module", "") or "<top>"
