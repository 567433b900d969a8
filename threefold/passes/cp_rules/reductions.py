"""cp rules for ops that reduce or run along one dim (reductions, softmaxes, scans, sorts,
norms) and losses: position-wise unless the dim is the sequence."""
from __future__ import annotations

import torch

from threefold.ops.families import op_name
from threefold.ops.rules import Op
from threefold.passes.cp_rules.core import PARTIAL, Call, Gather, Place, Seq, _fail, _norm, _val, rule
from threefold.passes.cp_rules.permutations import counts, feeds_offsets, routes_rows, sorted_rows
from threefold.passes.loss_form import _arg, _reduction_index
from threefold.runtime import cp_gather, cp_scan
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


def _reduced_dims(c: Call, rank: int):
    """The dims a reduction runs over (by name), or None for all of them."""
    dims = c.args.get("dim")
    if dims is None or dims == [] or dims == ():
        return None
    return [_norm(d, rank) for d in ([dims] if isinstance(dims, int) else dims)]


@rule(family="reduction")
def _reduce(c: Call):
    s0, src = c.place(c.x), _val(c.x)
    if not isinstance(s0, Seq):
        _fail(c, "reduces a whole value with a split one")
    dims = _reduced_dims(c, src.dim())
    if dims is None:
        if c.name in ("sum", "mean") and _loss_path(c.node):
            return PARTIAL
        _fail(c, "reduces over every position")
    if s0.dim in dims:
        if c.name in ("sum", "mean") and len(dims) == src.dim() and _loss_path(c.node):
            return PARTIAL
        if c.name == "sum" and feeds_offsets(c.node):
            return counts(c)                               # rows per expert of this rank's tokens
        if c.name in ("sum", "mean") and c.args.get("dtype") is None and s0.inner == 1 \
                and src.shape[s0.dim] == c.stage.seq_len and src.is_floating_point():
            # pooled over the sequence (a mean-pooled ViT): partial sums all-reduced, the same on every rank
            return Place(None, Op(cp_gather.reduce_seq, (c.x, dims, bool(c.args.get("keepdim")), c.name == "mean", CP),
                                  {"ranks": c.stage.plan.cp, "seq": s0.dim,
                                   **({"tail": c.stage.seq_tail} if getattr(c.stage, "seq_tail", 0) else {})}))
        _fail(c, f"reduces along the sequence (dim {s0.dim})")
    s = s0.at(s0.dim if c.args.get("keepdim") else s0.dim - sum(d < s0.dim for d in dims))
    return tuple(s for _ in c.out) if isinstance(c.out, (tuple, list)) else s


@rule(family="softmax")
@rule(family="scan")
@rule(family="sort")
def _along_dim(c: Call):
    """Ops that run along one dim (read by name: topk's second argument is k): position-wise
    unless that dim is the sequence; there an associative scan carries the blocks before
    (runtime/cp_scan.py) and the rest run on the gathered sequence."""
    s0, src = c.place(c.x), _val(c.x)
    if not isinstance(s0, Seq):
        _fail(c, "runs a whole value along a split one")
    d = c.args.get("dim")
    d = _norm((0 if c.name == "msort" else -1) if d is None else d, src.dim())
    if d == s0.dim:
        if c.name in ("sort", "argsort") and routes_rows(c.node):
            return sorted_rows(c, s0)                      # a routing sort: this rank's rows, sorted
        if c.name in cp_scan.CARRIED and s0.inner == 1 and src.shape[d] == c.stage.seq_len:
            # the sequence alone (not merged with the batch: a queue over all tokens gathers):
            # each block combined with the carry of the blocks before it
            return Place(s0, Op(cp_scan.scan_seq, (c.x, d, c.name, CP),
                                {"ranks": c.stage.plan.cp, "dtype": c.args.get("dtype")}))
        _fail(c, f"runs along the sequence (dim {d})")
    if c.name == "kthvalue" and not c.args.get("keepdim"):
        s0 = s0.at(s0.dim - (d < s0.dim))
    return tuple(s0 for _ in c.out) if isinstance(c.out, (tuple, list)) else s0


@rule(family="layer_norm")
def _layer_norm(c: Call):
    s0, shape = c.place(c.x), c.args["normalized_shape"]
    if s0 is None or s0.dim >= _val(c.x).dim() - len(shape):
        _fail(c, "normalizes over the sequence")
    return (s0, s0, s0) if c.name == "native_layer_norm" else s0


@rule(family="loss")
def _loss(c: Call):
    name, node = c.name, c.node
    x = c.x if c.x is not None else node.args[0]
    s0 = c.place(x)
    if name.startswith("vocab_parallel_cross_entropy"):
        reduction = c.args.get("reduction", 1)
        reduction = 0 if reduction == "none" else reduction
    else:
        reduction = _arg(node, _reduction_index(node), "reduction", 1)
    classes = name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd") and _val(x).dim() > 1
    if s0 is not None and classes and s0.dim == 1:
        _fail(c, "takes classes along the sequence dim")
    if reduction == 0:   # none: per position
        if s0 is None:
            return c.place(c.args.get("target", node.args[1]))
        return s0.at(s0.dim - 1) if classes and s0.dim > 1 else s0
    return PARTIAL


def _loss_path(node) -> bool:
    """The value reaches the graph output (the loss) through scalar ops only."""
    x = node
    for _ in range(16):
        users = [u for u in x.users if op_name(u) != "_assert_tensor_metadata"]
        if any(u.op == "output" for u in users):
            return True
        if len(users) != 1 or _val(users[0]) is None or _val(users[0]).dim() != 0:
            return False
        x = users[0]
    return False



@rule("batch_norm", "_native_batch_norm_legit_functional", "native_batch_norm", "group_norm", "native_group_norm",
      "instance_norm")
def _stats_norm(c: Call):
    """Norms whose statistics run over the batch and every position (batch norm over [B, C, L];
    group and instance norm over the positions of each row): exact on the gathered sequence."""
    s0 = c.place(c.x)
    if isinstance(s0, Seq) and s0.dim == 1 and c.name in ("batch_norm", "_native_batch_norm_legit_functional",
                                                          "native_batch_norm"):
        return tuple(s0 if isinstance(o, torch.Tensor) and o.dim() == _val(c.x).dim() else None for o in c.out) \
            if isinstance(c.out, (tuple, list)) else s0      # the sequence is the channel dim: per channel
    return Gather("normalizes with statistics over every position")
