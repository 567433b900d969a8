"""Tensor-parallel sharding rules: one pure function per op or op family (threefold/ops/).

A rule gets a `TpCall` (tp_decisions.py: the call, its arguments by schema name, its
inputs' placements and local values on the tp axis) whose inputs are not all plainly
replicated, and returns a `TpDecision`: the output's placement, how each input must arrive
(tp_redistribute: Cut, ENTER, Whole, Gathered) and, where the op itself does not run as
is, the op to run instead. Where it cannot follow the layout it refuses (NoRule): the pass
then runs the op on whole inputs and records the fallback. Rules never touch the graph.

Here: pointwise ops and copies, dim moves, softmax, reductions, norms, activation matmuls,
attention and losses; views, slices and joins are in tp_rules_views.py, ops that carry a
projection's shards further in tp_rules_share.py. `REGISTRY` holds them all.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.annotations import Collective
from threefold.ops import families as fam
from threefold.ops.rules import RESULT, Op
from threefold.passes.tp_decisions import REDUCE, REGISTRY, TpCall, TpDecision, global_val, meta_like, refuse
from threefold.passes.tp_placement import R, Partial, Replicate, Shard
from threefold.passes.tp_redistribute import ENTER, Cut, Whole
from threefold.passes import tp_rules_share, tp_rules_views  # noqa: F401  (they register their rules)
from threefold.runtime import tp_ops
from threefold.runtime.tp_ops import TP

aten = torch.ops.aten

__all__ = ["REGISTRY", "RULES", "is_elementwise"]


@REGISTRY.rule("dropout", family="pointwise", in_place=True)
@REGISTRY.rule(family="copy")
@REGISTRY.rule(family="like")
def elementwise(c: TpCall) -> TpDecision:
    """Pointwise ops with broadcasting: shards must agree; replicated operands that are not
    broadcast along the sharded dim are cut to this rank's part."""
    out_rank = len(c.out.shape)
    tensors = [v for v in c.args.values() if isinstance(v, fx.Node)]
    shard = None
    for a in tensors:
        p = c.place(a)
        if isinstance(p, Partial):
            refuse("gets a partial sum")
        if isinstance(p, Replicate) and p.gathered:
            refuse("uses a sequence-gathered value outside a matmul")
        if isinstance(p, Shard):
            cand = Shard(p.dim + out_rank - c.rank(a), p.blocks, p.seq)
            if shard is not None and shard != cand:
                refuse(f"combines values sharded {shard} and {cand}")
            shard = cand
    if shard is None:
        refuse("has no sharded operand")
    # the shards' size along their dim times t: the true size, or more where heads or
    # features are padded (tp_padding.py); a replicated operand must match it to be cut
    full = next(c.local(a).shape[c.place(a).dim] * c.t for a in tensors if isinstance(c.place(a), Shard))
    needs, cut = {}, set()
    for a in tensors:
        if not isinstance(c.place(a), Replicate):
            continue
        k = shard.dim - (out_rank - c.rank(a))
        if k >= 0 and c.local(a).shape[k] != 1:
            if not shard.seq and not shard.blocks and c.local(a).shape[k] != full:
                refuse(f"combines a shard padded to {full} with a whole value of {c.local(a).shape[k]}")
            needs[a], cut = Cut(k, shard), cut | {a}
        else:
            needs[a] = ENTER
    # A cut operand's gradient is made whole by the cut's backward (an all-gather);
    # operands broadcast over the shard (a norm weight, 1 + weight) get partial gradients.
    op = None
    if c.name == "dropout" and c.args["p"] != 0.0:
        x = c.args["input"]
        op = Op(tp_ops.tp_dropout, (x, c.args["p"], c.args["train"], TP), val=c.local(x))
    return TpDecision(shard, needs, op, uses="sharded", skip=frozenset(cut))


@REGISTRY.rule("max", "min")
def max_min(c: TpCall) -> TpDecision:
    """max/min: the two-tensor overloads are pointwise (XGLM's mask clamp); the reductions
    (values and indices) are not followed."""
    if c.node.target in (aten.max.other, aten.min.other, aten.maximum.default, aten.minimum.default):
        return elementwise(c)
    refuse("reduces with max/min (values and indices)")


def is_elementwise(node: fx.Node) -> bool:
    """Whether tp runs `node` by the elementwise rule (each entry alone: safe on padding)."""
    return REGISTRY.lookup(fam.op_name(node), node) in (elementwise, max_min)


@REGISTRY.rule("_assert_tensor_metadata")
def no_value(c: TpCall) -> TpDecision:
    x = c.args["a"]
    return TpDecision(c.place(x), same_as=x)


# -- dims moved -----------------------------------------------------------------------------

@REGISTRY.rule("transpose")
def transpose(c: TpCall) -> TpDecision:
    x = c.x
    s, n = c.shard(x), c.rank(x)
    a, b = c.args["dim0"] % n, c.args["dim1"] % n
    return TpDecision(s.moved(b if s.dim == a else a if s.dim == b else s.dim))


@REGISTRY.rule("t")
def t(c: TpCall) -> TpDecision:
    s = c.shard(c.x)
    return TpDecision(s.moved(1 - s.dim) if c.rank(c.x) == 2 else s)


@REGISTRY.rule("permute")
def permute(c: TpCall) -> TpDecision:
    s, n = c.shard(c.x), c.rank(c.x)
    return TpDecision(s.moved([d % n for d in c.args["dims"]].index(s.dim)))


@REGISTRY.rule("unsqueeze")
def unsqueeze(c: TpCall) -> TpDecision:
    s = c.shard(c.x)
    k = c.args["dim"] % (c.rank(c.x) + 1)
    return TpDecision(s.moved(s.dim + (1 if k <= s.dim else 0)))


@REGISTRY.rule("squeeze")
def squeeze(c: TpCall) -> TpDecision:
    x = c.x
    s, n, shape = c.shard(x), c.rank(x), c.local(x).shape
    dims = c.args.get("dim")
    dims = [i for i in range(n) if shape[i] == 1] if dims is None else dims
    dims = [d % n for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    dims = [d for d in dims if shape[d] == 1]
    if s.dim in dims:
        refuse("squeezes the sharded dim")
    return TpDecision(s.moved(s.dim - sum(1 for d in dims if d < s.dim)))


# -- along one dim ----------------------------------------------------------------------------

@REGISTRY.rule(family="softmax")
def softmax(c: TpCall) -> TpDecision:
    s = c.shard(c.x)
    if c.args["dim"] % c.rank(c.x) == s.dim:
        refuse("normalises over the sharded dim")
    return TpDecision(s)


@REGISTRY.rule("sum", "mean", "amax", "amin")
def reduction(c: TpCall) -> TpDecision:
    """Over other dims the shard stays; a sum (mean) over the sharded dim is a sum of local
    sums, all-reduced (the mean divides by the global count)."""
    x = c.x
    s, n = c.shard(x), c.rank(x)
    dims = c.args.get("dim")
    dims = list(range(n)) if dims is None or (isinstance(dims, (list, tuple)) and not dims) else \
        [d % n for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keepdim = bool(c.args.get("keepdim") or False)
    if s.dim in dims and c.name in ("sum", "mean") and not c.args.get("dtype"):
        then = (REDUCE,)
        if c.name == "mean":
            count = 1
            for d in dims:
                count *= global_val(x).shape[d]
            then += (Op(aten.div.Tensor, (RESULT, count), place=Replicate()),)
        return TpDecision(Replicate(), op=Op(aten.sum.dim_IntList, (x, dims, keepdim), place=Partial()), then=then)
    if s.dim in dims:
        refuse("reduces over the sharded dim")
    return TpDecision(s.moved(s.dim if keepdim else s.dim - sum(1 for k in dims if k < s.dim)))


@REGISTRY.rule("layer_norm", "rms_norm")
def norm(c: TpCall) -> TpDecision:
    """layer_norm / rms_norm over trailing dims that are not sharded (sequence shards)."""
    s = c.shard(c.x)
    if s.dim >= c.rank(c.x) - len(c.args["normalized_shape"]):
        refuse("normalises over the sharded dim")
    return TpDecision(s, uses="sharded")


# -- matmuls of activations, attention ---------------------------------------------------------

@REGISTRY.rule("matmul", "bmm", "baddbmm")
def activation_matmul(c: TpCall) -> TpDecision:
    """matmul/bmm/baddbmm of two activations (attention): shards on a batch dim must agree
    (blocks included); a shard of the rows of the left or the columns of the right operand
    carries to the output; both sharded on the contracted dim give a partial sum."""
    added = c.args["self"] if c.name == "baddbmm" else None
    a, b = (c.args["batch1"], c.args["batch2"]) if added is not None else \
        (c.args["self"], c.args["mat2"] if c.name == "bmm" else c.args["other"])
    ra, rb, out_rank = c.rank(a), c.rank(b), len(c.out.shape)
    sa, sb = (p if isinstance(p := c.place(v), Shard) else None for v in (a, b))
    if added is None and sa and sb and sa.dim == ra - 1 and sb.dim == rb - 2 and sa.blocks == sb.blocks:
        return TpDecision(R, op=Op(c.node.target, (a, b), c.node.kwargs, place=Partial()), then=(REDUCE,))
    out = None
    for s, r, matrix_dim in ((sa, ra, ra - 2), (sb, rb, rb - 1)):
        if s is None:
            continue
        if s.dim == matrix_dim and r >= 2:
            cand = Shard(out_rank - 2 if s is sa else out_rank - 1, s.blocks)
        elif s.dim >= r - 2:
            refuse(f"multiplies along a sharded matrix dim ({s})")
        else:
            cand = Shard(s.dim + out_rank - r, s.blocks)
        if out is not None and out != cand:
            refuse("multiplies values sharded on different dims")
        out = cand
    if out is None:
        refuse("multiplies values neither of which is sharded")
    if out.dim >= out_rank - 2 and sa is not None and sb is not None:
        refuse("multiplies values both sharded on matrix dims")

    def need(x, r):
        k = out.dim - (out_rank - r)
        if isinstance(c.place(x), Replicate) and out.dim < out_rank - 2 and k >= 0 and c.local(x).shape[k] != 1:
            return Cut(k, out)
        return ENTER
    needs = {a: need(a, ra), b: need(b, rb)}
    if added is not None:   # baddbmm's added input: elementwise with the output
        k = out.dim - (out_rank - c.rank(added))
        if isinstance(c.place(added), Shard):
            if c.place(added) != Shard(k, out.blocks):
                refuse("adds a value sharded differently")
        elif k >= 0 and c.local(added).shape[k] != 1:
            needs[added] = Cut(k, out)
        else:
            needs[added] = ENTER
    return TpDecision(out, needs)


@REGISTRY.rule("scaled_dot_product_attention")
def sdpa(c: TpCall) -> TpDecision:
    """Attention with q, k, v sharded on the heads dim (whole ones cut so); a mask with
    heads is cut too."""
    qkv = [c.args[k] for k in ("query", "key", "value")]
    shards = {c.place(x) for x in qkv if isinstance(c.place(x), Shard)}
    if len(shards) != 1 or next(iter(shards)).dim != 1 or next(iter(shards)).blocks:
        refuse("runs attention on values not all sharded on the heads dim")
    heads = Shard(1)
    needs = {x: Cut(1, heads) for x in qkv if not isinstance(c.place(x), Shard)}
    mask = c.args.get("attn_mask")
    if isinstance(mask, fx.Node) and c.rank(mask) == 4 and c.local(mask).shape[1] != 1:
        needs[mask] = Cut(1, heads)
    return TpDecision(heads, needs)


# -- losses -------------------------------------------------------------------------------------

@REGISTRY.rule("cross_entropy_loss")
def cross_entropy(c: TpCall) -> TpDecision:
    """Over logits [N, V] sharded on the vocabulary: the vocab-parallel cross-entropy."""
    logits, target = c.args["self"], c.args["target"]
    s = c.place(logits)
    r = c.rank(logits)
    if not isinstance(s, Shard) or s.dim != r - 1 or r != 2 or s.blocks:
        refuse("computes cross-entropy over logits not sharded on the vocabulary of [N, V]")
    if c.args.get("weight") is not None:
        refuse("uses class weights")
    reduction, ignore, smoothing = c.args["reduction"], c.args["ignore_index"], c.args["label_smoothing"]
    vocab = global_val(logits).shape[-1]
    n = c.local(logits).shape[0]
    out = meta_like(c.out)
    if reduction == 1 and not smoothing:
        op = Op(tp_ops.vocab_parallel_cross_entropy, (logits, target, ignore, vocab, TP), val=out,
                collective=Collective("all_reduce", "forward", n, count=2))
    else:
        red = {0: "none", 1: "mean", 2: "sum"}[reduction]
        op = Op(tp_ops.vocab_parallel_cross_entropy_full, (logits, target, ignore, vocab, float(smoothing), red, TP),
                val=out, collective=Collective("all_reduce", "forward", 3 * n, count=2))
    return TpDecision(Replicate(), {target: Whole()}, op)


@REGISTRY.rule("call_loss")
def eager_loss(c: TpCall) -> TpDecision:
    """The user's loss run as Python (compiler/eager_loss.py) sees whole values: its inputs
    are gathered (vocab padding cut off), its scalar is the same on every tp rank."""
    v = c.out
    val = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
    return TpDecision(R, {a: Whole(exact=True) for a in c.node.all_input_nodes},
                      Op(c.node.target, c.node.args, c.node.kwargs, val=val), uses="whole")


# Every op name with a rule of its own or through a family listed in ops/families.py (the
# pointwise family also covers every op ATen tags pointwise: REGISTRY.lookup).
RULES = {n: REGISTRY.lookup(n) for n in sorted(REGISTRY.names())}
