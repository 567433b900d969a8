"""Compile entry point: a workload plus a plan -> the final stage (Fused) of the passes.

The compiler takes workload values; SPEC strings are loaded by the front end (threefold/api.py
`compile`, the CLI), so compiling never imports a user's file."""
from __future__ import annotations

from typing import Callable

import torch

from threefold.compiler.eager_loss import eager_node, loss_reduction
from threefold.compiler.pipeline import run_passes
from threefold.ir.program import tf
from threefold.ir.stages import Fused, Traced
from threefold.compiler.trace import trace
from threefold.errors import PlanError
from threefold.passes.batch_coupling import check_batch_coupling
from threefold.passes.batch_dims import AmbiguousBatch, find_batch_dims
from threefold.compiler.seq_choice import compile_each_candidate
from threefold.compiler.seq_inner import compile_inner
from threefold.passes.seq_dims import AmbiguousSeq, find_seq_dims, full_length_refusal, full_length_tables, local_share, \
    read_at_local_length, seq_tail_of
from threefold.placement import Shard, place_on
from threefold.plan import Plan
from threefold.workload import Workload


def microbatch(values, parts: int, what: str, dims=None):
    """The first of `parts` equal slices of each tensor along its batch dim (dims: one per
    value, None = not split; default dim 0); its shape is what we trace."""

    def one(t, d):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or d is None:
            return t
        if t.shape[d] % parts:
            raise PlanError(f"{what}: batch size {t.shape[d]} is not divisible by dp*m={parts}; "
                            f"use a global batch that is a multiple of {parts}")
        return t.narrow(d, 0, t.shape[d] // parts)
    if isinstance(values, tuple):
        dims = [0] * len(values) if dims is None else dims
        return tuple(one(v, d) for v, d in zip(values, dims))
    return one(values, 0 if dims is None else dims)


def compile_workload(workload: Workload | dict, plan: Plan | str | None = None,
                     progress: Callable[[str], None] | None = None, own_loss: bool = False) -> Fused:
    """Trace a workload at microbatch size and run the pass pipeline for `plan`.

    `progress(stage)` is told "trace" and then each pass's name as it starts. `own_loss`:
    without a loss_fn, train on the loss the model returns (compiler/trace.py)."""
    if isinstance(workload, str):
        raise PlanError(f"compile_workload takes a workload, not the SPEC {workload!r}: load it with "
                        "threefold.workload.load_spec, or call threefold.compile, which does")
    workload = Workload.coerce(workload)
    plan = Plan.parse(plan)
    parts = plan.dp * plan.microbatches
    name = type(workload.model).__name__
    has_target = workload.loss_fn is not None
    batch = tuple(workload.inputs) + ((workload.target,) if has_target else ())
    notes: list[str] = []
    declared = workload.batch_dims
    if declared is not None and not isinstance(declared, int) and not has_target \
            and len(declared) == len(batch) + 1:
        declared = tuple(declared)[:-1]  # a target's entry given for a forward-only workload
    try:
        dims = find_batch_dims(workload.model, batch, len(workload.inputs), parts, declared, name, notes,
                               workload.loss_fn)
    except AmbiguousBatch as exc:
        dims = _name_coupling(workload, batch, parts, plan, exc, own_loss)
        if dims is None:
            raise
        notes.append(f"batch dims {dims}: rows coupled by ops the plan accepts per microbatch, "
                     "so no split could be checked numerically; the usual dim 0 is taken")
    sliced = microbatch(batch, parts, name, dims)
    rows = _rows_for_cp(workload, batch, dims, plan, declared, name) if plan.cp > 1 and parts == 1 else dims

    image_like = plan.cp > 1 and any(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in workload.inputs)

    def inner(cause=None):   # cp from where the sequence is born inside the model (compiler/seq_inner.py)
        if image_like and cause is not None:   # already asked, below: no birth point
            raise cause
        return compile_inner(workload, plan, name, batch, dims, sliced, parts, list(notes), progress, own_loss,
                             _finish, cause)
    # an image-like input (rank >= 3): its dims may merely divide like a sequence (a ViT's H and W);
    # where the model makes its sequence from it, cutting an input dim is not cutting the sequence
    if image_like:
        prog = inner()
        if prog is not None:
            return prog
    try:
        seq_dims = find_seq_dims(batch, rows, len(workload.inputs), plan.cp, name)
    except AmbiguousSeq as exc:   # several dims could be the sequence: keep the only one cp compiles
        if len(exc.candidates) < 2:
            return inner(exc)
        return compile_each_candidate(exc, lambda chosen: _compile_split(
            workload, plan, name, batch, dims, sliced, parts, list(notes), progress, own_loss,
            find_seq_dims(batch, rows, len(workload.inputs), plan.cp, name, chosen)), inner)
    return _compile_split(workload, plan, name, batch, dims, sliced, parts, notes, progress, own_loss, seq_dims)


def _compile_split(workload, plan, name, batch, dims, sliced, parts, notes, progress, own_loss, seq_dims):
    """Trace this cp rank's share (sequence dims `seq_dims`) and run the passes."""
    has_target = workload.loss_fn is not None
    if plan.cp > 1:   # trace this cp rank's share of each sequence (passes/context_parallel.py)
        sliced = local_share(sliced, seq_dims, plan.cp)
    inputs, target = (sliced[:-1], sliced[-1]) if has_target else (sliced, None)
    if progress is not None:
        progress("trace")
    try:
        traced = trace(workload.model, inputs, target, workload.loss_fn, plan, own_loss=own_loss)
    except PlanError as exc:   # a full-length position table used whole (x + self.pos, ViT)?
        whole = [batch[i].shape[d] for i, d in enumerate(seq_dims) if d is not None]
        refusal = full_length_refusal(workload.model, whole[0], plan.cp, name, str(exc)) \
            if plan.cp > 1 and whole else None
        if refusal is None:
            raise _share_refusal(workload, plan, name, batch, seq_dims, has_target, own_loss, exc) from None
        for table in full_length_tables(workload.model, whole[0], plan.cp, str(exc))[:4]:
            prog = _compile_reading(workload, table, whole[0], plan, inputs, target, own_loss, progress,
                                    dims, sliced, seq_dims, batch, parts, notes)
            if prog is not None:
                return prog
        raise refusal from None
    if plan.cp > 1:
        traced = traced.evolve(retrace=_retracer(workload, inputs, target, plan, own_loss, seq_dims))
    return _finish(traced, workload, dims, sliced, seq_dims, batch, parts, plan, notes, progress)


def _share_refusal(workload, plan, name, batch, seq_dims, has_target, own_loss, exc) -> PlanError:
    """Why this cp rank's share does not trace: where the model traces whole (cp=1), the cut dim
    is not a sequence it treats position by position (features, a model without a sequence),
    said in one line; else the trace's own error stands."""
    cut = [(i, d) for i, d in enumerate(seq_dims) if d is not None]
    if plan.cp == 1 or not cut:
        return exc
    whole = tuple(batch)
    inputs, target = (whole[:-1], whole[-1]) if has_target else (whole, None)
    try:
        trace(workload.model, inputs, target, workload.loss_fn, plan.replace(cp=1), own_loss=own_loss)
    except Exception:   # it does not trace whole either: the trace's error is the answer
        return exc
    i, d = cut[0]
    length = batch[i].shape[d]
    return PlanError(f"{name}: cp={plan.cp} cuts input {i} {tuple(batch[i].shape)} along dim {d} ({length} -> "
                     f"{-(-length // (2 * plan.cp)) * 2} positions per rank) and the model does not trace on that share "
                     f"({str(exc).splitlines()[0][:200]}), though it traces whole: dim {d} is not a sequence the model "
                     "treats position by position (features? a model without a sequence?); use cp=1")


def _rows_for_cp(workload: Workload, batch: tuple, dims: list, plan: Plan, declared, name: str) -> list:
    """The batch dims cp must skip when looking for the sequence, where dp*m = 1 splits none:
    found by data flow as for a split in two (a seq-first [S, B] input has its rows on dim 1);
    dim 0 where that cannot tell (a batch of one row, rows the model couples)."""
    if declared is not None:
        return dims
    try:
        return find_batch_dims(workload.model, batch, len(workload.inputs), 2, None, name, [], workload.loss_fn)
    except (PlanError, AmbiguousBatch):
        return dims


def _retracer(workload: Workload, inputs: tuple, target, plan: Plan, own_loss: bool, seq_dims: list):
    """n -> the model's graph traced on inputs whose sequence dims hold n positions (the local
    share's tokens repeated): cp reads a mask over the whole sequence from the model traced at
    the whole length (passes/cp_masks.py). Traced on demand, once per n (a full export)."""
    graphs: dict = {}

    def at(x, d, n):
        if d is None or not isinstance(x, torch.Tensor):
            return x
        return x.index_select(d, torch.arange(n, device=x.device) % x.shape[d])

    def retrace(n: int):
        if n not in graphs:
            values = tuple(inputs) + ((target,) if target is not None else ())
            values = tuple(at(x, d, n) for x, d in zip(values, seq_dims))
            ins, tgt = (values[:-1], values[-1]) if target is not None else (values, None)
            graphs[n] = trace(workload.model, ins, tgt, workload.loss_fn, plan, own_loss=own_loss).gm.graph
        return graphs[n]
    return retrace


def _finish(traced, workload, dims, sliced, seq_dims, batch, parts, plan, notes, progress, seq_len=None,
            seq_tail=None):
    """`seq_len`, `seq_tail`: the local length and the padding where no input carries the
    sequence (compiler/seq_birth.py)."""
    rows = [sliced[i].shape[d] for i, d in enumerate(dims) if d is not None]
    lengths = [seq_len] if seq_len else [sliced[i].shape[d] for i, d in enumerate(seq_dims) if d is not None]
    if plan.cp > 1:   # each input's sequence dim: its cp entry, which the cp pass starts from
        _place_inputs(traced.gm, "cp", seq_dims)
    traced = traced.evolve(batch_dims=list(dims), micro_rows=rows[0] if rows else None,
                           notes=traced.notes + tuple(notes),
                           seq_len=lengths[0] if plan.cp > 1 and lengths else None,
                           seq_tail=(seq_tail if seq_tail is not None else seq_tail_of(batch, seq_dims, plan.cp))
                           if plan.cp > 1 else 0)
    traced = traced.evolve(output_batch_dims=_output_batch_dims(traced, dims, batch, parts))
    eager = eager_node(traced)
    if eager is not None and parts > 1:   # how the eager loss combines rows, measured once
        tf(eager)["eager_reduction"] = loss_reduction(workload.model, batch, dims, workload.loss_fn)
    return run_passes(traced, progress=progress)


def _place_inputs(gm, axis: str, dims: list) -> None:
    """Write `axis`'s entry (S(d), threefold/placement.OnMesh) on each user input of a
    freshly traced graph (no pass has read it yet) where `dims` has its dim."""
    for node in gm.graph.nodes:
        i = tf(node).get("input_index") if node.op == "placeholder" and tf(node).get("kind") == "input" else None
        if i is not None and i < len(dims) and dims[i] is not None:
            place_on(node, axis, Shard(dims[i]))


def _compile_reading(workload, table, length, plan, inputs, target, own_loss, progress, *rest):
    """Compile with one full-length table read at the local length (seq_dims.read_at_local_length):
    the program if cp then read it at this rank's global positions, else None."""
    try:
        with read_at_local_length(workload.model, [table], length // plan.cp):
            traced = trace(workload.model, inputs, target, workload.loss_fn, plan, own_loss=own_loss)
        traced = traced.evolve(retrace=_retracer(workload, inputs, target, plan, own_loss, rest[2]))
        prog = _finish(traced, workload, *rest[:5], plan, rest[5], progress)
    except Exception:   # this candidate is not the position table (a pass failed on it): try the next
        return None
    return prog if f"`{table[1]}`" in " ".join(prog.notes) else None


def _name_coupling(workload: Workload, batch: tuple, parts: int, plan: Plan, exc, own_loss: bool = False) -> list | None:
    """No split of the inputs gave slices of the full output: when that is because an op
    couples the rows along the usual candidate (dim 0), raise the batch-coupling error
    naming that op instead of the guess about dimensions. Where the plan opted in to
    per-microbatch results for those ops (loss=microbatch_mean, batchnorm=local), that
    candidate is the answer; else None (the caller re-raises)."""
    zeros = [c for c in exc.candidates if all(d in (None, 0) for d in c)]
    if not zeros:
        return None
    dims = max(zeros, key=lambda c: sum(d == 0 for d in c))
    has_target = workload.loss_fn is not None
    sliced = microbatch(batch, parts, type(workload.model).__name__, dims)
    inputs, target = (sliced[:-1], sliced[-1]) if has_target else (sliced, None)
    try:
        traced = trace(workload.model, inputs, target, workload.loss_fn, plan, own_loss=own_loss)
    except PlanError:
        return None
    rows = [sliced[i].shape[d] for i, d in enumerate(dims) if d is not None]
    checked = check_batch_coupling(traced.evolve(batch_dims=list(dims), micro_rows=rows[0] if rows else None))
    opted = any(n.startswith(("loss=microbatch_mean:", "batchnorm=local:")) for n in checked.notes)
    return list(dims) if opted else None


def _output_batch_dims(prog: Traced, dims: list, batch: tuple, parts: int) -> list:
    """Per model output: the dim that carries the batch (pm.forward() concatenates the
    microbatches' outputs along it). It is the dim whose length is the microbatch's row
    count; where several are, the one at the inputs' batch dim; else dim 0."""
    rows = prog.micro_rows
    split = [d for d in dims if d is not None]
    out = []
    # with a loss the graph's output is the loss; pm(x) returns the model's outputs
    for meta in (prog.model_output_meta if prog.has_loss else prog.output_meta):
        hits = [d for d, s in enumerate(meta.shape) if rows is not None and s == rows]
        if len(hits) > 1 and split and split[0] in hits:
            hits = [split[0]]
        out.append(hits[0] if hits else 0)
    return out
