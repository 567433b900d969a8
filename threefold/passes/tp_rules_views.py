"""Tensor-parallel rules for views, slices, indexing and joins (pure, registered on
tp_decisions.REGISTRY; see tp_rules.py for what a rule gets and returns)."""
from __future__ import annotations

import operator

import torch

from threefold.errors import PlanError
from threefold.ops.families import RESHAPES
from threefold.ops.rules import Op
from threefold.passes.tp_decisions import REGISTRY, TpCall, TpDecision, global_val, refuse
from threefold.passes.tp_dims import padded_reshape, reshape_placement
from threefold.passes.tp_placement import Replicate, Shard
from threefold.passes.tp_redistribute import Cut, Gathered

aten = torch.ops.aten


@REGISTRY.rule(*RESHAPES, "flatten", "unflatten")
def reshape(c: TpCall) -> TpDecision:
    """view/reshape/flatten/unflatten by a dimension map (tp_dims.reshape_placement): the
    sharded dim may sit anywhere in a group of merged dims (the result is block-strided:
    Bloom's [batch*heads]) and a block-strided dim splits back into its factors."""
    x = c.x
    s = c.place(x)
    if isinstance(s, Replicate) and s.gathered:
        return TpDecision(s)
    if not isinstance(s, Shard):
        refuse(f"reshapes a value placed {s}")
    src_global, dst_global, src_local = list(global_val(x).shape), list(c.out.shape), list(c.local(x).shape)
    padded = not s.seq and not s.blocks and src_local[s.dim] * c.t != src_global[s.dim]
    try:
        if padded:   # heads or features padded for tp (tp_padding.py)
            out_place, dst_local = padded_reshape(src_global, src_local, dst_global, s, c.t)
        else:
            out_place, dst_local = reshape_placement(src_global, src_local, dst_global, s, c.t)
    except PlanError as exc:
        if not s.seq:
            refuse(f"reshapes {src_global} -> {dst_global} with the shard {s} ({exc})")
        out_place = None
    if out_place is not None and s.seq and out_place.blocks:
        out_place = None   # sequence shards stay plain (SP's all-gathers and reduce-scatters)
    if out_place is None:
        if s.seq:  # a sequence shard can always be gathered back (GPT-2's x.view(-1, C));
            # a plain gather (slice in backward) is right whatever reads the result
            return TpDecision(Replicate(), {x: Gathered(s.dim)}, Op(aten.reshape.default, (x, dst_global)))
        refuse(f"reshapes {src_global} -> {dst_global} in a way that splits the shard {s}")
    if c.name in ("flatten", "unflatten") or not _viewable(c.local(x), dst_local):
        # export drops a no-op .contiguous(); local strides (from the traced values) may not
        # allow a view, and a reshape computes the same values
        return TpDecision(out_place, op=Op(aten.reshape.default, (x, dst_local)))
    return TpDecision(out_place, op=Op(c.node.target, (x, dst_local) + tuple(c.node.args[2:]), c.node.kwargs))


def _viewable(v, shape) -> bool:
    try:
        v.view(shape)
        return True
    except RuntimeError:
        return False


@REGISTRY.rule("expand", "broadcast_to")
def expand(c: TpCall) -> TpDecision:
    x = c.x
    s = c.shard(x)
    sizes = list(c.args["size"])
    d = s.dim + len(sizes) - c.rank(x)
    if sizes[d] != -1:
        sizes[d] = c.local(x).shape[s.dim]
    return TpDecision(s.moved(d), op=Op(c.node.target, (x, sizes) + tuple(c.node.args[2:]), c.node.kwargs))


@REGISTRY.rule("repeat_interleave")
def repeat_interleave(c: TpCall) -> TpDecision:
    """Repeating each element of the sharded dim (GQA's k/v heads to q heads) keeps the
    shard: rank r's kv heads are the ones its q heads read."""
    x, repeats, dim = c.args.get("self"), c.args.get("repeats"), c.args.get("dim")
    if x is None or dim is None or not isinstance(repeats, int):
        refuse("repeats a sharded value flattened or by a tensor of counts")
    s = c.shard(x)
    dim %= c.rank(x)
    if s.blocks and dim == s.dim:
        refuse("repeats a block-sharded dim")
    return TpDecision(s, op=Op(aten.repeat_interleave.self_int, (x, repeats, dim)))


@REGISTRY.rule("index")
def index(c: TpCall) -> TpDecision:
    """x[..., idx, ...] with index tensors on dims other than the sharded one (replicated
    indices): the sharded dim keeps its place, or moves by the indexed dims' change in rank."""
    s = c.shard(c.x)
    indices = list(c.args["indices"])
    where = [i for i, ix in enumerate(indices) if ix is not None]
    if not where or s.dim in where or where != list(range(where[0], where[-1] + 1)):
        refuse("indexes the sharded dim")
    ixs = [indices[i] for i in where]
    if any(not isinstance(c.place(ix), Replicate) for ix in ixs):
        refuse("indexes with sharded indices")
    if s.dim < where[0]:
        return TpDecision(s)
    return TpDecision(s.moved(s.dim - len(where) + max(c.rank(ix) for ix in ixs)))


@REGISTRY.rule("split", "split_with_sizes", "chunk")
def split(c: TpCall) -> TpDecision:
    x = c.x
    s = c.shard(x)
    dim = c.args["dim"] % c.rank(x)
    outs = c.out
    if dim != s.dim:
        return TpDecision([s] * len(outs))
    sizes = [int(o.shape[dim]) for o in outs]
    if not s.blocks or list(s.blocks) != sizes:
        refuse(f"splits the sharded dim into {sizes} but the shard holds blocks {list(s.blocks)}")
    local = [b // c.t for b in sizes]
    return TpDecision([Shard(dim, (), s.seq)] * len(local), op=Op(aten.split_with_sizes.default, (x, local, dim)))


@REGISTRY.rule("getitem")
def getitem(c: TpCall) -> TpDecision:
    x, i = c.node.args[0], c.node.args[1]
    places = c.place(x)
    return TpDecision(places[i] if isinstance(places, list) else places,
                      op=Op(operator.getitem, (x, i), val=c.local(x)[i]))


@REGISTRY.rule("slice")
def slice_(c: TpCall) -> TpDecision:
    """Slices of other dims keep the shard; a slice of a block-strided dim that takes whole
    blocks (q = qkv[..., :C] of a fused projection) takes the same blocks locally."""
    x = c.x
    s = c.shard(x)
    dim = c.args["dim"] % c.rank(x)
    if dim != s.dim:
        return TpDecision(s)
    full = global_val(x).shape[dim]
    start = c.args["start"] if c.args.get("start") is not None else 0
    end = c.args["end"] if c.args.get("end") is not None else full
    start, end = (start + full if start < 0 else start), min(end + full if end < 0 else end, full)
    if c.args.get("step", 1) != 1:
        refuse("slices the sharded dim with a step")
    if start == 0 and end >= full:
        return TpDecision(s, same_as=x)
    blocks = list(s.blocks) or [full]
    cuts = [sum(blocks[:i]) for i in range(len(blocks) + 1)]
    if start not in cuts or end not in cuts:
        refuse(f"slices [{start}:{end}] of the sharded dim across its pieces {blocks}")
    i, j = cuts.index(start), cuts.index(end)
    lo, hi = sum(b // c.t for b in blocks[:i]), sum(b // c.t for b in blocks[:j])
    taken = tuple(blocks[i:j])
    return TpDecision(Shard(dim, taken if len(taken) > 1 else (), s.seq), op=Op(aten.slice.Tensor, (x, dim, lo, hi)))


@REGISTRY.rule("narrow")
def narrow(c: TpCall) -> TpDecision:
    """narrow(x, dim, start, length): a slice by another name."""
    x = c.x
    s = c.shard(x)
    dim = c.args["dim"] % c.rank(x)
    if dim != s.dim:
        return TpDecision(s)
    if c.args["start"] == 0 and c.args["length"] == global_val(x).shape[dim]:
        return TpDecision(s, same_as=x)
    refuse("narrows the sharded dim")


@REGISTRY.rule("index_select")
def index_select(c: TpCall) -> TpDecision:
    """index_select along a dim other than the sharded one, with replicated indices."""
    s = c.place(c.x)
    if not isinstance(s, Shard) or c.args["dim"] % c.rank(c.x) == s.dim \
            or not isinstance(c.place(c.args["index"]), Replicate):
        refuse("selects indices along the sharded dim (or with sharded indices)")
    return TpDecision(s)


@REGISTRY.rule("select")
def select(c: TpCall) -> TpDecision:
    s = c.shard(c.x)
    dim = c.args["dim"] % c.rank(c.x)
    if dim == s.dim:
        refuse("selects along the sharded dim")
    return TpDecision(s.moved(s.dim - (1 if dim < s.dim else 0)))


def _joined(c: TpCall, verb: str) -> tuple[Shard, dict]:
    """The one shard the joined values share, and the cuts that bring whole ones to it."""
    tensors = list(c.args["tensors"])
    shards = {c.place(a) for a in tensors if isinstance(c.place(a), Shard)}
    if len(shards) != 1:
        refuse(f"{verb} values sharded differently")
    s = shards.pop()
    return s, {a: Cut(s.dim, s) for a in tensors if not isinstance(c.place(a), Shard)}


@REGISTRY.rule(family="join")
def join(c: TpCall) -> TpDecision:
    return stack(c) if c.name == "stack" else cat(c)


def cat(c: TpCall) -> TpDecision:
    dim = c.args["dim"] % c.rank(c.args["tensors"][0])
    s, needs = _joined(c, "concatenates")
    if dim == s.dim:
        refuse("concatenates along the sharded dim")
    return TpDecision(s, needs)


def stack(c: TpCall) -> TpDecision:
    dim = c.args["dim"] % (c.rank(c.args["tensors"][0]) + 1)
    s, needs = _joined(c, "stacks")
    return TpDecision(s.moved(s.dim + (1 if dim <= s.dim else 0)), needs)
