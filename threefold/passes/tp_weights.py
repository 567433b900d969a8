"""Tensor-parallel decisions for weight matmuls and embeddings: Megatron's column and row
parallel linears and the vocab-parallel embedding.

`weight_matmul` decides a matmul with a parameter weight from its input's placement: a
replicated input makes it column-parallel (weight cut on the output features, f before it,
fused projections cut block-wise, heads tp does not divide padded), an input sharded on the
contracted dim row-parallel (output Partial, reduced by g or, under sp, reduce-scattered;
the bias added after). An embedding indexed by user input is vocab-parallel. Each returns a
`TpDecision` naming the parameter cuts it needs (`ParamCut`) and how its inputs arrive
(`MatmulInput`, `LocalParam`, `Reapplied`); the pass writes it (tensor_parallel.py) and
checks the cuts against those already decided. They read the rewrite's state, never write it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ops.families import GROUPED_MATMULS
from threefold.ops.rules import RESULT, Gather, Op
from threefold.passes.cost import op_name
from threefold.passes.tp_decisions import REDUCE, ParamCut, ReduceScatter, TpDecision
from threefold.passes.tp_patterns import _coll, _feeds_cross_entropy, _head_count, _is_param, _split_blocks
from threefold.passes.tp_placement import P, R, Partial, Replicate, Shard, local_size, padded, to_meta
from threefold.passes.tp_redistribute import NoRule, Whole, replicated
from threefold.ops.families import TRANSPOSES
from threefold.runtime import tp_ops
from threefold.runtime.tp_ops import TP

aten = torch.ops.aten


# -- how a weight matmul's operands arrive (Decision.needs) ------------------------------------

@dataclass(frozen=True)
class MatmulInput:
    """A matmul's activation: a partial sum reduced, f's input or a gathered sequence's
    source read back, then as `mode` says: "f" (column-parallel: a sequence shard gathered,
    whose backward reduce-scatters the ranks' partial input gradients; anything else through
    f), "whole" (replicated as the single process has it, for a matmul every rank computes
    whole: its input gradient is whole on every rank, so a sequence shard is gathered by a
    plain all-gather whose backward slices), "" (row-parallel: as it is)."""
    mode: str

    def bring(self, rw, x: fx.Node, old: fx.Node) -> fx.Node:
        p = rw.place[x]
        if isinstance(p, Partial):
            x, p = rw.g(x), R
        if isinstance(p, Replicate) and (p.partial_grad or p.gathered):
            x, p = replicated(rw, x)[0], R
        if self.mode == "whole":
            return replicated(rw, x, old.meta.get("val"))[0]
        if self.mode == "f" and isinstance(p, Shard) and p.seq:
            return rw.gather_seq(x, p.dim)
        return rw.f(x) if self.mode == "f" else x


@dataclass(frozen=True)
class LocalParam:
    """A parameter as this rank holds it once its cut is decided; `mask`: (dim, true size)
    of an input padded for tp, whose padding columns are masked out of the gradient."""
    mask: tuple | None = None

    def bring(self, rw, x: fx.Node, old: fx.Node) -> fx.Node:
        w = rw.param_arg(old)
        if self.mask is not None:
            w = rw.emit(tp_ops.mask_padding, (w, *self.mask, TP), place=rw.place[w], val=rw.val[w])
        return w


@dataclass(frozen=True)
class Reapplied:
    """A view of a parameter (`W.T`) read by a matmul that cuts the parameter: emitted again
    on the parameter as it arrives (`param`); the old view may be left unused (then erased).
    `own_meta`: the new node carries the view's module, not the matmul's."""
    param: LocalParam
    own_meta: bool = False

    def bring(self, rw, x: fx.Node, old: fx.Node) -> fx.Node:
        w_old = old.args[0]
        w = self.param.bring(rw, rw.env[w_old], w_old)
        rw.maybe_dead.append(x)
        return rw.emit(old.target, (w,) + tuple(old.args[1:]), dict(old.kwargs), place=R,
                       src=old if self.own_meta else None)


def matmul_input_place(rw, x: fx.Node):
    """The activation's placement once MatmulInput has read a value back (before any mode)."""
    p = rw.place[x]
    if isinstance(p, Partial) or (isinstance(p, Replicate) and (p.partial_grad or p.gathered)):
        return R
    return p


# -- the decisions -------------------------------------------------------------------------------

def weight_matmul(rw, old, name, x_old, w_old, b_old, out_dim):
    """Column-parallel, row-parallel, kept whole, or a NoRule (the pass gathers)."""
    px = matmul_input_place(rw, rw.env[x_old])
    fqn = tf(w_old)["fqn"]
    w_shape = list(rw.prog.state[fqn].shape)
    in_dim = 1 - out_dim if len(w_shape) == 2 else 3 - out_dim   # [E, in, out] expert weights
    whole_why, pad_to, padded_note = None, None, None
    if fqn not in rw.decisions and (isinstance(px, Replicate) or (isinstance(px, Shard) and px.seq)):
        heads = _head_count(old)
        out = w_shape[out_dim]
        plain = not _feeds_cross_entropy(old) and not _split_blocks(old, out)
        strict = rw.prog.plan.strict
        if fqn in rw.avoid:
            why = rw.avoid[fqn]
            whole_why = why if why.startswith("its padded") else \
                f"its shards would reach {why}, which has no sharded rule"
        elif heads is not None and heads % rw.t and plain:
            if strict and heads > rw.t:
                local_size(heads, rw.t, f"tp={rw.t}: heads of {fqn}")  # raises
            if heads > rw.t and not strict:   # pad by whole heads (tp_padding.py)
                pad_to = -(-heads // rw.t) * rw.t * (out // heads)
                padded_note = f"{heads} heads padded to {pad_to * heads // out} for tp={rw.t}"
            else:
                whole_why = f"its {heads} heads do not divide by tp"
        elif out % rw.t and plain:
            if out > rw.t and not strict:
                pad_to = padded(out, rw.t)
                padded_note = f"{out} output features padded to {pad_to} for tp={rw.t}"
            else:
                whole_why = f"its {out} output features do not divide by tp"
    if whole_why is not None:
        # GQA/MQA k/v projections whose heads tp does not divide, or projections whose
        # shards would only be gathered again: every rank computes them whole
        whole = frozenset([fqn] + ([tf(b_old)["fqn"]] if b_old is not None else []))
        return TpDecision(R, {x_old: MatmulInput("whole")}, Op(old.target, old.args, old.kwargs,
                                                               val=to_meta(old.meta.get("val"))),
                          kept=((fqn, whole_why),), whole_uses=whole)
    if isinstance(px, Replicate) or (isinstance(px, Shard) and px.seq):
        return _column(rw, old, name, x_old, w_old, b_old, fqn, w_shape, out_dim, pad_to, padded_note)
    last = len(px_val(rw, x_old).shape) - 1
    if isinstance(px, Shard) and px.dim == last \
            and rw.decisions.get(fqn, (in_dim, px.blocks))[:2] == (in_dim, px.blocks):   # shared weights
        return _row(rw, old, name, x_old, px, w_old, b_old, fqn, w_shape, in_dim)
    # sharded on a batch dim (or the weight is already split another way): gather, then
    # treat it as a replicated input
    return Gather(f"multiplies weight {fqn} with an input sharded {px}")


def px_val(rw, x_old):
    return rw.val[rw.env[x_old]]


def _column(rw, old, name, x_old, w_old, b_old, fqn, w_shape, out_dim, pad_to, padded_note):
    out = w_shape[out_dim]
    blocks = () if pad_to else _split_blocks(old, out)
    what = f"tp={rw.t}: output features of {fqn}"
    notes = ()
    if pad_to:
        pad = pad_to
        notes = (f"{fqn}: {padded_note} (zero rows; its row-parallel partner gets zero columns)",)
    elif blocks:
        for b in blocks:
            local_size(b, rw.t, what + f" (block of {b} of a fused projection)")
        pad = out
        if fqn in rw.decisions and rw.decisions[fqn][1] != blocks:
            raise NoRule(f"tp={rw.t}: {fqn} is already split as blocks {list(rw.decisions[fqn][1])}")
    elif out % rw.t:
        if not _feeds_cross_entropy(old):
            local_size(out, rw.t, what)  # raises
        pad = padded(out, rw.t)
        notes = (f"{fqn}: vocabulary {out} padded to {pad} for tp={rw.t}",)
    else:
        pad = out
    cuts = (ParamCut(fqn, out_dim, blocks, pad),) + \
        ((ParamCut(tf(b_old)["fqn"], 0, blocks, pad),) if b_old is not None else ())
    needs = {x_old: MatmulInput("f"), w_old: LocalParam()}
    if b_old is not None:
        needs[b_old] = LocalParam()
    arg = old.args[1] if len(old.args) > 1 else None
    if (name in ("mm", "matmul") or name in GROUPED_MATMULS) and _transposed_param(arg):
        needs[arg] = Reapplied(LocalParam(), own_meta=True)
    return TpDecision(Shard(len(old.meta["val"].shape) - 1, blocks), needs, cuts=cuts, notes=notes,
                      origin=frozenset([fqn]), padded=((fqn, padded_note),) if padded_note else ())


def _transposed_param(arg) -> bool:
    return isinstance(arg, fx.Node) and not _is_param(arg) and op_name(arg) in TRANSPOSES


def _row(rw, old, name, x_old, px, w_old, b_old, fqn, w_shape, in_dim):
    true_in = w_shape[in_dim]
    # an input padded for tp (tp_padding.py) meets zero columns, whose gradient is masked
    pad = true_in if px.blocks else px_val(rw, x_old).shape[-1] * rw.t
    mask = LocalParam((in_dim, true_in) if pad != true_in else None)
    target = {"linear": aten.linear.default, "addmm": aten.mm.default}.get(name, old.target)
    w_arg = old.args[2] if name == "addmm" else old.args[1]
    needs = {w_arg: mask if _is_param(w_arg) else Reapplied(mask)}
    extra = tuple(old.args[2:]) if name in GROUPED_MATMULS else ()   # group offsets
    sp = rw.sp and len(old.meta["val"].shape) == 3
    out = Shard(1, seq=True) if sp else R
    then = (ReduceScatter(1) if sp else REDUCE,)
    if b_old is not None:
        then += (Op(aten.add.Tensor, (RESULT, b_old), place=out),)
    return TpDecision(out, needs, Op(target, (x_old, w_arg) + extra, place=P, name=f"{old.name}_partial"), then,
                      cuts=(ParamCut(fqn, in_dim, px.blocks, pad),),
                      uses=("sharded" if sp else "whole") if b_old is not None else None,
                      padded=((fqn, f"{true_in} input features padded to {pad} for tp={rw.t}"),)
                      if pad != true_in else ())


def embedding(rw, old):
    """The vocab-parallel embedding (an embedding indexed by user input)."""
    w_old, ids_old = old.args[0], old.args[1]
    fqn = tf(w_old)["fqn"]
    rows = rw.prog.state[fqn].shape[0]
    pad = padded(rows, rw.t)
    notes = (f"{fqn}: vocabulary {rows} padded to {pad} for tp={rw.t}",) if pad != rows else ()
    padding_idx = old.args[2] if len(old.args) > 2 else old.kwargs.get("padding_idx", -1)
    if (old.args[3] if len(old.args) > 3 else old.kwargs.get("scale_grad_by_freq", False)):
        raise PlanError(f"tp={rw.t}: embedding {fqn} uses scale_grad_by_freq, which the "
                        "vocab-parallel embedding does not support; turn it off or use tp=1")
    needs = {w_old: LocalParam(), ids_old: Whole()}
    cut = (ParamCut(fqn, 0, (), pad),)
    full = to_meta(old.meta["val"])
    if rw.sp and full.dim() == 3:
        shape = list(full.shape)
        shape[1], extra, note = rw.seq_shard_of(shape[1])
        val = torch.empty(shape, dtype=full.dtype, device="meta")
        op = Op(tp_ops.vocab_parallel_embedding, (w_old, ids_old, TP, 1, padding_idx, *extra), val=val,
                collective=_coll("reduce_scatter", "forward", full, back="all_gather"))
        return TpDecision(Shard(1, seq=True), needs, op, cuts=cut, notes=notes + ((note,) if note else ()),
                          seq_len=extra[0] if extra else None)
    args = (w_old, ids_old, TP) + ((None, padding_idx) if padding_idx >= 0 else ())
    op = Op(tp_ops.vocab_parallel_embedding, args, val=full, collective=_coll("all_reduce", "forward", full))
    return TpDecision(R, needs, op, cuts=cut, notes=notes)


__all__ = ["LocalParam", "MatmulInput", "Reapplied", "embedding", "matmul_input_place",
           "weight_matmul"]
