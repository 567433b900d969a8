"""Compile cp (plan `cp=N`) from where the sequence is born inside the model (compiler/seq_birth.py).

Tried first for a model with an image-like input (rank >= 3), and where no input dim is the
sequence (compiler/seq_choice.py, compiler/api.py). The model is traced whole once (cp=1) to find
the birth point, then again with the cut there, at this rank's local length. A value of the
whole length that meets the cut sequence element-wise after it (a learned position table added
whole, `x + self.pos`, or one interpolated to the image in forward) is cut to this rank's
positions by the same trace (seq_birth._Calls); a table used otherwise is read at the local
length as for a split input (passes/seq_dims.py read_at_local_length), at this rank's global
positions. A per-token target along the born sequence is cut like it (seq_birth.along_birth).
"""
from __future__ import annotations

from contextlib import nullcontext

from threefold.compiler.seq_birth import along_birth, calls_of, find_birth, to_shard_seq
from threefold.compiler.trace import trace
from threefold.errors import PlanError
from threefold.passes.seq_dims import full_length_tables, local_share, read_at_local_length
from threefold.runtime.cp_ops import seq_tail


def compile_inner(workload, plan, name, batch, dims, sliced, parts, notes, progress, own_loss, finish, cause=None):
    """The program with cp starting at the sequence's birth; where the model has no birth point
    (an input carries the sequence, or there is no attention), raise `cause`, or None without one."""
    model, cp = workload.model, plan.cp
    has_target = workload.loss_fn is not None
    inputs, target = (sliced[:-1], sliced[-1]) if has_target else (sliced, None)
    try:
        with calls_of(model) as seen:
            whole = trace(model, inputs, target, workload.loss_fn, plan.replace(cp=1), own_loss=own_loss)
    except Exception:   # the model does not trace whole either: the first error stands
        if cause is None:
            return None
        raise cause from None
    graph = whole.gm.graph
    birth = find_birth(graph)
    if birth is None:
        if cause is None:
            return None
        raise cause
    val = next(n for n in graph.nodes if n.name == birth.node).meta["val"]
    if birth.call is None or seen.shapes.get(birth.call) != tuple(val.shape) or not birth.dims:
        raise PlanError(f"{name}: cp={cp}: the sequence is born inside the model at `{birth.node}` ({birth.module}), "
                        "but the torch call that makes it could not be found again to cut it there; use cp=1")
    failed = []
    for dim in birth.dims:   # a born value with several dims of that length: the one that compiles
        try:
            return _compile_cut(workload, plan, name, birth, dim, graph, batch, dims, sliced, parts, notes,
                                progress, own_loss, finish)
        except PlanError as err:
            failed.append(err)
    raise failed[0]


def _compile_cut(workload, plan, name, birth, dim, graph, batch, dims, sliced, parts, notes, progress, own_loss,
                 finish):
    """The program with the born value cut along `dim`, else a PlanError naming why."""
    model, cp = workload.model, plan.cp
    tail = seq_tail(birth.length, cp)   # a born length 2*cp does not divide is padded (passes/cp_padding.py)
    n = (birth.length + tail) // cp
    seq_dims = along_birth(batch, dims, birth)   # a per-token target is cut as the sequence is
    local = local_share(sliced, seq_dims, cp)
    inputs, target = (local[:-1], local[-1]) if workload.loss_fn is not None else (local, None)
    failed = []
    for table in [None] + full_length_tables(model, birth.length, cp)[:4]:
        try:
            with read_at_local_length(model, [table], n) if table else nullcontext(), \
                    calls_of(model, birth.call, dim, cp, birth.length) as cutting:
                traced = trace(model, inputs, target, workload.loss_fn, plan, own_loss=own_loss)
            if not cutting.done or to_shard_seq(traced.gm, cp) != 1 + cutting.also:
                raise PlanError("the cut was not traced")
            traced = traced.evolve(retrace=lambda m: _whole(graph, m, birth.length))
            also = [f"cp: {cutting.also} value(s) of all {birth.length} positions (a position table added whole, "
                    "or interpolated to the image in forward) meet the cut sequence element-wise: cut to this "
                    "rank's positions too"] if cutting.also else []
            prog = finish(traced, workload, dims, sliced, seq_dims, batch, parts, plan,
                          notes + [birth.note(cp, dim)] + also, progress, seq_len=n, seq_tail=tail)
        except Exception as err:   # this table is not the position table (or none is needed): the next
            failed.append(f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
            continue
        if table is None or f"`{table[1]}`" in " ".join(prog.notes):
            return prog
        failed.append(f"the table `{table[1]}` was not read at this rank's positions")
    raise PlanError(f"{name}: cp={cp}: the sequence is born inside the model at `{birth.node}` ({birth.module}, "
                    f"{birth.length} positions), but cp cannot run from there: {failed[0]}")


def _whole(graph, m: int, length: int):
    """The model traced at the whole length (cp_masks, cp_whole read twins there); no other length."""
    if m != length:
        raise PlanError(f"the sequence is born inside the model with {length} positions, not {m}")
    return graph


__all__ = ["compile_inner"]
