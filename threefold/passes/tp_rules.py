"""Per-ATen-op sharding rules for the tensor-parallel pass (a table keyed by op name).

Each rule gets the rewriter and the old node (at least one input is not plainly
replicated), emits the local op(s) and returns the new node, whose placement it sets.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from threefold.ir.annotations import Collective
from threefold.passes.cost import op_name
from threefold.errors import PlanError
from threefold.passes.tp_dims import reshape_placement
from threefold.passes.tp_padding import padded_reshape
from threefold.passes.tp_placement import Partial, Replicate, Shard
from threefold.passes.tp_redistribute import NoRule, replicated
from threefold.runtime import tp_ops
from threefold.runtime.tp_ops import TP

aten = torch.ops.aten


def _rank(v) -> int:
    return len(v.shape)


def _shard_of(rw, node) -> Shard | None:
    p = rw.place[node]
    return p if isinstance(p, Shard) else None


def _fail(rw, why: str):
    """No sharded rule for this layout: the rewriter redistributes (tp_redistribute)."""
    raise NoRule(f"tp={rw.t}: {rw._where()} {why}; use tp=1 for this model or restructure it")


def _entering_shards(rw, a):
    """A replicated activation that is broadcast over a shard: each rank's gradient for it
    is a summand, so it enters through f (all-reduce backward), as Megatron's f does.
    Parameters (and values made from them alone) are summed by tp_grad_sync instead."""
    p = rw.place[a]
    if not isinstance(p, Replicate) or p.partial_grad or not _has_grad(rw.val[a]):
        return a
    old = rw.old_of.get(a)
    if old is None or rw._param_sources(old) is not None or not rw.has_grad(old):
        return a
    return rw.f(a)


def _has_grad(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def elementwise(rw, old):
    """Pointwise ops with broadcasting: shards must agree; replicated operands that are
    not broadcast along the sharded dim are sliced to this rank's part."""
    out_rank = _rank(old.meta["val"])
    args = rw._map(old.args)
    kwargs = rw._map(old.kwargs)
    shard = None
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, fx.Node)]
    for a in tensors:
        p = rw.place[a]
        if isinstance(p, Partial):
            _fail(rw, "gets a partial sum")
        if isinstance(p, Replicate) and p.gathered:
            _fail(rw, "uses a sequence-gathered value outside a matmul")
        if isinstance(p, Shard):
            d = p.dim + out_rank - _rank(rw.val[a])
            cand = Shard(d, p.blocks, p.seq)
            if shard is not None and shard != cand:
                _fail(rw, f"combines values sharded {shard} and {cand}")
            shard = cand
    sliced = set()
    # the shards' size along their dim times t: the true size, or more where heads or
    # features are padded (tp_padding.py); a replicated operand must match it to be cut
    full = next((rw.val[a].shape[rw.place[a].dim] * rw.t for a in tensors if isinstance(rw.place[a], Shard)), None)

    def fix(a):
        if not isinstance(a, fx.Node) or not isinstance(rw.place[a], Replicate):
            return a
        k = shard.dim - (out_rank - _rank(rw.val[a]))
        if k >= 0 and rw.val[a].shape[k] != 1:
            if not shard.seq and not shard.blocks and rw.val[a].shape[k] != full:
                _fail(rw, f"combines a shard padded to {full} with a whole value of {rw.val[a].shape[k]}")
            sliced.add(a)
            if shard.blocks:
                return rw.scatter_blocks(a, k, shard.blocks)
            return rw.scatter(a, k, seq=shard.seq)
        return _entering_shards(rw, a)
    args = tuple(fix(a) for a in args)
    kwargs = {k: fix(v) for k, v in kwargs.items()}
    # A sliced operand's gradient is made whole by the slice's backward (an all-gather);
    # operands broadcast over the shard (a norm weight, 1 + weight) get partial gradients.
    rw._note_param_uses(old, sharded=True, skip={o for o in old.all_input_nodes if rw.env[o] in sliced})
    name = op_name(old)
    if name == "dropout" and old.args[1] != 0.0:
        return rw.emit(tp_ops.tp_dropout, (args[0], args[1], args[2], TP), place=shard,
                       val=rw.val[args[0]])
    return rw.emit(old.target, args, kwargs, place=shard)


def max_min(rw, old):
    """max/min: the two-tensor overloads are pointwise (XGLM's mask clamp); the reductions
    over a dim other than the sharded one keep it."""
    if old.target in (aten.max.other, aten.min.other, aten.maximum.default, aten.minimum.default):
        return elementwise(rw, old)
    _fail(rw, "reduces with max/min (values and indices)")


def transpose(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    a, b = old.args[1] % n, old.args[2] % n
    d = b if s.dim == a else a if s.dim == b else s.dim
    return rw.copy_node(old, place=s.moved(d))


def t(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    return rw.copy_node(old, place=s.moved(1 - s.dim) if _rank(rw.val[x]) == 2 else s)


def permute(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    dims = [d % n for d in old.args[1]]
    return rw.copy_node(old, place=s.moved(dims.index(s.dim)))


def unsqueeze(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    k = old.args[1] % (_rank(rw.val[x]) + 1)
    return rw.copy_node(old, place=s.moved(s.dim + (1 if k <= s.dim else 0)))


def squeeze(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    dims = old.args[1] if len(old.args) > 1 else [i for i in range(n) if rw.val[x].shape[i] == 1]
    dims = [d % n for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    dims = [d for d in dims if rw.val[x].shape[d] == 1]
    if s.dim in dims:
        _fail(rw, "squeezes the sharded dim")
    return rw.copy_node(old, place=s.moved(s.dim - sum(1 for d in dims if d < s.dim)))


def reshape(rw, old):
    """view/reshape/flatten/unflatten by a dimension map (tp_dims.reshape_placement): the
    sharded dim may sit anywhere in a group of merged dims (the result is block-strided:
    Bloom's [batch*heads]) and a block-strided dim splits back into its factors."""
    x = rw.env[old.args[0]]
    s = rw.place[x]
    if isinstance(s, Replicate) and s.gathered:
        return rw.copy_node(old, val=None, place=s)
    if not isinstance(s, Shard):
        _fail(rw, f"reshapes a value placed {s}")
    src_global = list(old.args[0].meta["val"].shape)
    dst_global = list(old.meta["val"].shape)
    src_local = list(rw.val[x].shape)
    padded = not s.seq and not s.blocks and src_local[s.dim] * rw.t != src_global[s.dim]
    try:
        if padded:   # heads or features padded for tp (tp_padding.py)
            out_place, dst_local = padded_reshape(src_global, src_local, dst_global, s, rw.t)
        else:
            out_place, dst_local = reshape_placement(src_global, src_local, dst_global, s, rw.t)
    except PlanError as exc:
        if not s.seq:
            _fail(rw, f"reshapes {src_global} -> {dst_global} with the shard {s} ({exc})")
        out_place = None
    if out_place is not None and s.seq and out_place.blocks:
        out_place = None   # sequence shards stay plain (SP's all-gathers and reduce-scatters)
    if out_place is None:
        if s.seq:  # a sequence shard can always be gathered back (GPT-2's x.view(-1, C));
            # a plain gather (slice in backward) is right whatever reads the result
            whole = rw.gather(x, s.dim)
            return rw.emit(aten.reshape.default, (whole, dst_global), place=rw.place[whole])
        _fail(rw, f"reshapes {src_global} -> {dst_global} in a way that splits the shard {s}")
    target = old.target
    if op_name(old) in ("flatten", "unflatten") or not _viewable(rw.val[x], dst_local):
        # export drops a no-op .contiguous(); local strides (from the traced values) may not
        # allow a view, and a reshape computes the same values
        target = aten.reshape.default
    args = (x, dst_local) + (tuple(rw._map(old.args[2:])) if target is old.target else ())
    return rw.emit(target, args, rw._map(old.kwargs) if target is old.target else {}, place=out_place)


def _viewable(v, shape) -> bool:
    try:
        v.view(shape)
        return True
    except RuntimeError:
        return False


def expand(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    sizes = list(old.args[1])
    d = s.dim + len(sizes) - _rank(rw.val[x])
    if sizes[d] != -1:
        sizes[d] = rw.val[x].shape[s.dim]
    return rw.emit(old.target, (x, sizes) + tuple(rw._map(old.args[2:])), rw._map(old.kwargs), place=s.moved(d))


def split(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    dim = (old.args[2] if len(old.args) > 2 else old.kwargs.get("dim", 0)) % n
    outs = old.meta["val"]
    if dim != s.dim:
        return rw.copy_node(old, place=[s] * len(outs))
    sizes = [int(o.shape[dim]) for o in outs]
    if not s.blocks or list(s.blocks) != sizes:
        _fail(rw, f"splits the sharded dim into {sizes} but the shard holds blocks {list(s.blocks)}")
    local = [b // rw.t for b in sizes]
    target = aten.split_with_sizes.default
    return rw.emit(target, (x, local, dim), place=[Shard(dim, (), s.seq)] * len(local))


def getitem(rw, old):
    x = rw.env[old.args[0]]
    places = rw.place[x]
    place = places[old.args[1]] if isinstance(places, list) else places
    return rw.emit(operator.getitem, (x, old.args[1]), place=place, val=rw.val[x][old.args[1]])


def slice_(rw, old):
    """Slices of other dims keep the shard; a slice of a block-strided dim that takes whole
    blocks (q = qkv[..., :C] of a fused projection) takes the same blocks locally."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    dim = (old.args[1] if len(old.args) > 1 else 0) % n
    if dim != s.dim:
        return rw.copy_node(old, place=s)
    full = old.args[0].meta["val"].shape[dim]
    start = old.args[2] if len(old.args) > 2 and old.args[2] is not None else 0
    end = old.args[3] if len(old.args) > 3 and old.args[3] is not None else full
    step = old.args[4] if len(old.args) > 4 else 1
    start, end = (start + full if start < 0 else start), min(end + full if end < 0 else end, full)
    if step != 1:
        _fail(rw, "slices the sharded dim with a step")
    if start == 0 and end >= full:
        return x
    blocks = list(s.blocks) or [full]
    cuts = [sum(blocks[:i]) for i in range(len(blocks) + 1)]
    if start not in cuts or end not in cuts:
        _fail(rw, f"slices [{start}:{end}] of the sharded dim across its pieces {blocks}")
    i, j = cuts.index(start), cuts.index(end)
    lo, hi = sum(b // rw.t for b in blocks[:i]), sum(b // rw.t for b in blocks[:j])
    taken = tuple(blocks[i:j])
    return rw.emit(aten.slice.Tensor, (x, dim, lo, hi), place=Shard(dim, taken if len(taken) > 1 else (), s.seq))


def narrow(rw, old):
    """narrow(x, dim, start, length): a slice by another name."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    dim = old.args[1] % _rank(rw.val[x])
    if dim != s.dim:
        return rw.copy_node(old, place=s)
    start, length = old.args[2], old.args[3]
    full = old.args[0].meta["val"].shape[dim]
    if start == 0 and length == full:
        return x
    _fail(rw, "narrows the sharded dim")


def index_select(rw, old):
    """index_select / gather-free indexing along a dim other than the sharded one."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    if s is None or old.args[1] % _rank(rw.val[x]) == s.dim or not isinstance(rw.place[rw.env[old.args[2]]], Replicate):
        _fail(rw, "selects indices along the sharded dim (or with sharded indices)")
    return rw.copy_node(old, place=s)


def select(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    dim = old.args[1] % _rank(rw.val[x])
    if dim == s.dim:
        _fail(rw, "selects along the sharded dim")
    return rw.copy_node(old, place=s.moved(s.dim - (1 if dim < s.dim else 0)))


def cat(rw, old):
    tensors = [rw.env[a] for a in old.args[0]]
    n = _rank(rw.val[tensors[0]])
    dim = (old.args[1] if len(old.args) > 1 else 0) % n
    shards = {rw.place[a] for a in tensors if isinstance(rw.place[a], Shard)}
    if len(shards) != 1:
        _fail(rw, "concatenates values sharded differently")
    s = shards.pop()
    if dim == s.dim:
        _fail(rw, "concatenates along the sharded dim")
    fixed = [a if isinstance(rw.place[a], Shard) else rw.scatter_like(a, s.dim, s) for a in tensors]
    return rw.emit(old.target, (fixed,) + tuple(rw._map(old.args[1:])), rw._map(old.kwargs), place=s)


def stack(rw, old):
    tensors = [rw.env[a] for a in old.args[0]]
    n = _rank(rw.val[tensors[0]])
    dim = (old.args[1] if len(old.args) > 1 else 0) % (n + 1)
    shards = {rw.place[a] for a in tensors if isinstance(rw.place[a], Shard)}
    if len(shards) != 1:
        _fail(rw, "stacks values sharded differently")
    s = shards.pop()
    fixed = [a if isinstance(rw.place[a], Shard) else rw.scatter_like(a, s.dim, s) for a in tensors]
    return rw.emit(old.target, (fixed,) + tuple(rw._map(old.args[1:])), rw._map(old.kwargs),
                   place=s.moved(s.dim + (1 if dim <= s.dim else 0)))


def softmax(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    if old.args[1] % _rank(rw.val[x]) == s.dim:
        _fail(rw, "normalises over the sharded dim")
    return rw.copy_node(old, place=s)


def reduction(rw, old):
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    dims = old.args[1] if len(old.args) > 1 else None
    dims = list(range(n)) if dims is None else [d % n for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keepdim = bool(old.args[2]) if len(old.args) > 2 else bool(old.kwargs.get("keepdim", False))
    if s.dim in dims and op_name(old) in ("sum", "mean") and not old.kwargs.get("dtype"):
        # a sum of local sums (all-reduce); the mean divides by the global count
        local = rw.emit(aten.sum.dim_IntList, (x, dims, keepdim), place=Partial())
        total = rw.g(local)
        if op_name(old) == "mean":
            count = 1
            for d in dims:
                count *= old.args[0].meta["val"].shape[d]
            total = rw.emit(aten.div.Tensor, (total, count), place=Replicate())
        return total
    if s.dim in dims:
        _fail(rw, "reduces over the sharded dim")
    d = s.dim if keepdim else s.dim - sum(1 for k in dims if k < s.dim)
    return rw.copy_node(old, place=s.moved(d))


def norm(rw, old):
    """layer_norm / rms_norm over trailing dims that are not sharded (sequence shards)."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    if s.dim >= _rank(rw.val[x]) - len(old.args[1]):
        _fail(rw, "normalises over the sharded dim")
    rw._note_param_uses(old, sharded=True)
    return rw.copy_node(old, place=s)


def repeat_interleave(rw, old):
    """Repeating each element of the sharded dim (GQA's k/v heads to q heads) keeps the
    shard: rank r's kv heads are the ones its q heads read."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    repeats = old.args[1] if len(old.args) > 1 else old.kwargs.get("repeats")
    dim = old.args[2] if len(old.args) > 2 else old.kwargs.get("dim")
    if dim is None or not isinstance(repeats, int):
        _fail(rw, "repeats a sharded value flattened or by a tensor of counts")
    dim %= _rank(rw.val[x])
    if s.blocks and dim == s.dim:
        _fail(rw, "repeats a block-sharded dim")
    return rw.emit(aten.repeat_interleave.self_int, (x, repeats, dim), place=s)


def index(rw, old):
    """x[..., idx, ...] with index tensors on dims other than the sharded one (replicated
    indices): the sharded dim keeps its place, or moves by the indexed dims' change in rank."""
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    indices = list(old.args[1])
    where = [i for i, ix in enumerate(indices) if ix is not None]
    if not where or s.dim in where or where != list(range(where[0], where[-1] + 1)):
        _fail(rw, "indexes the sharded dim")
    ixs = [rw.env[indices[i]] for i in where]
    if any(not isinstance(rw.place[ix], Replicate) for ix in ixs):
        _fail(rw, "indexes with sharded indices")
    if s.dim < where[0]:
        d = s.dim
    else:
        rank = max(_rank(rw.val[ix]) for ix in ixs)
        d = s.dim - len(where) + rank
    return rw.copy_node(old, place=s.moved(d))


def activation_matmul(rw, old):
    """matmul/bmm/baddbmm of two activations (attention): shards on a batch dim must agree
    (blocks included); a shard of the rows of the left or the columns of the right operand
    carries to the output; both sharded on the contracted dim give a partial sum."""
    name = op_name(old)
    first = 1 if name == "baddbmm" else 0
    a, b = rw.env[old.args[first]], rw.env[old.args[first + 1]]
    ra, rb = _rank(rw.val[a]), _rank(rw.val[b])
    out_rank = _rank(old.meta["val"])
    sa, sb = _shard_of(rw, a), _shard_of(rw, b)
    if first == 0 and sa and sb and sa.dim == ra - 1 and sb.dim == rb - 2 and sa.blocks == sb.blocks:
        return rw.g(rw.copy_node(old, args=(a, b), place=Partial()))
    out = None
    for s, r, matrix_dim in ((sa, ra, ra - 2), (sb, rb, rb - 1)):
        if s is None:
            continue
        if s.dim == matrix_dim and r >= 2:
            cand = Shard(out_rank - 2 if s is sa else out_rank - 1, s.blocks)
        elif s.dim >= r - 2:
            _fail(rw, f"multiplies along a sharded matrix dim ({s})")
        else:
            cand = Shard(s.dim + out_rank - r, s.blocks)
        if out is not None and out != cand:
            _fail(rw, "multiplies values sharded on different dims")
        out = cand
    if out.dim >= out_rank - 2 and sa is not None and sb is not None:
        _fail(rw, "multiplies values both sharded on matrix dims")

    def fix(x, r, batch_only=True):
        k = out.dim - (out_rank - r)
        if isinstance(rw.place[x], Replicate) and out.dim < out_rank - 2 and k >= 0 and rw.val[x].shape[k] != 1:
            return rw.scatter_like(x, k, out)
        return _entering_shards(rw, x)
    args = [fix(a, ra), fix(b, rb)]
    if first:   # baddbmm's added input: elementwise with the output
        c = rw.env[old.args[0]]
        rc = _rank(rw.val[c])
        k = out.dim - (out_rank - rc)
        if isinstance(rw.place[c], Shard):
            if rw.place[c] != Shard(k, out.blocks):
                _fail(rw, "adds a value sharded differently")
        elif k >= 0 and rw.val[c].shape[k] != 1:
            c = rw.scatter_like(c, k, out)
        else:
            c = _entering_shards(rw, c)
        args = [c] + args
    return rw.copy_node(old, args=tuple(args) + tuple(rw._map(old.args[first + 2:])), place=out)


def sdpa(rw, old):
    q, k, v = (rw.env[a] for a in old.args[:3])
    shards = {rw.place[x] for x in (q, k, v) if isinstance(rw.place[x], Shard)}
    if len(shards) != 1 or next(iter(shards)).dim != 1 or next(iter(shards)).blocks:
        _fail(rw, "runs attention on values not all sharded on the heads dim")
    fixed = [x if isinstance(rw.place[x], Shard) else rw.scatter(x, 1) for x in (q, k, v)]
    rest = list(rw._map(old.args[3:]))
    kwargs = dict(rw._map(old.kwargs))
    mask = rest[0] if rest else kwargs.get("attn_mask")
    if isinstance(mask, fx.Node) and _rank(rw.val[mask]) == 4 and rw.val[mask].shape[1] != 1:
        mask = rw.scatter(mask, 1)
        if rest:
            rest[0] = mask
        else:
            kwargs["attn_mask"] = mask
    return rw.emit(old.target, tuple(fixed) + tuple(rest), kwargs, place=Shard(1))


def cross_entropy(rw, old):
    logits, target = rw.env[old.args[0]], rw.env[old.args[1]]
    s = _shard_of(rw, logits)
    weight = old.args[2] if len(old.args) > 2 else old.kwargs.get("weight")
    reduction_ = old.args[3] if len(old.args) > 3 else old.kwargs.get("reduction", 1)
    ignore = old.args[4] if len(old.args) > 4 else old.kwargs.get("ignore_index", -100)
    smoothing = old.args[5] if len(old.args) > 5 else old.kwargs.get("label_smoothing", 0.0)
    if s is None or s.dim != _rank(rw.val[logits]) - 1 or _rank(rw.val[logits]) != 2 or s.blocks:
        _fail(rw, "computes cross-entropy over logits not sharded on the vocabulary of [N, V]")
    if weight is not None:
        _fail(rw, "uses class weights")
    target = rw.to_replicated(target)
    vocab = old.args[0].meta["val"].shape[-1]
    n = rw.val[logits].shape[0]
    out = _meta_like(old.meta["val"])
    coll = Collective("all_reduce", "forward", n, count=2)
    if reduction_ == 1 and not smoothing:
        return rw.emit(tp_ops.vocab_parallel_cross_entropy, (logits, target, ignore, vocab, TP),
                       place=Replicate(), val=out, collective=coll)
    red = {0: "none", 1: "mean", 2: "sum"}[reduction_]
    coll = Collective("all_reduce", "forward", 3 * n, count=2)
    return rw.emit(tp_ops.vocab_parallel_cross_entropy_full,
                   (logits, target, ignore, vocab, float(smoothing), red, TP),
                   place=Replicate(), val=out, collective=coll)


def _meta_like(v):
    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")


_ELEMENTWISE = [
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
    "silu", "gelu", "relu", "erf", "abs", "masked_fill", "where", "_to_copy", "to", "type_as",
    "clone", "contiguous", "alias", "detach", "dropout", "reciprocal", "bitwise_not", "eq", "ne",
    "lt", "gt", "le", "ge", "logical_not", "logical_and", "logical_or", "clamp", "minimum",
    "maximum", "sin", "cos", "square", "lift_fresh_copy", "lerp", "fill", "zeros_like",
    "ones_like", "full_like", "softplus", "leaky_relu", "hardtanh", "log1p", "expm1",
]

def eager_loss(rw, old: fx.Node) -> fx.Node:
    """The user's loss run as Python (compiler/eager_loss.py) sees whole values: its inputs
    are gathered (vocab padding cut off), its scalar is the same on every tp rank."""
    args = fx.node.map_arg(old.args, lambda a: replicated(rw, rw.env[a], a.meta.get("val"))[0])
    rw._note_param_uses(old, sharded=False)
    v = old.meta["val"]
    return rw.copy_node(old, args=args, val=torch.empty(tuple(v.shape), dtype=v.dtype, device="meta"))


# What may run on a sequence shard whose last rank holds padding rows (a length tp does not
# divide): ops that treat each row alone. Anything that mixes rows along the padded dim runs
# on the gathered, cut value instead (the fallback).
_ROW_WISE = {"layer_norm", "native_layer_norm", "rms_norm", "dropout", "native_dropout", "clone",
             "_to_copy", "alias", "detach", "getitem", "call_loss", "contiguous"}


def padding_safe(name: str, old: fx.Node, dims: set) -> bool:
    base = name[:-1] if name.endswith("_") and name[:-1] in _IN_PLACE_OK else name
    x = old.args[0] if old.args else None
    ndim = x.meta["val"].dim() if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) else 0
    if base in ("layer_norm", "native_layer_norm", "rms_norm"):
        k = len(old.args[1]) if len(old.args) > 1 else 1
        return not dims & set(range(ndim - k, ndim))
    if base in _ROW_WISE or base in _ELEMENTWISE:
        return True
    if base in ("sum", "mean", "amax", "amin") and len(old.args) > 1 and old.args[1] is not None:
        reduced = old.args[1] if isinstance(old.args[1], (list, tuple)) else [old.args[1]]
        return not dims & {d % max(ndim, 1) for d in reduced}
    return False


# in-place variants (clamp_, add_, mul_ ...) follow the same rule on their local shard
_IN_PLACE_OK = set(_ELEMENTWISE)

RULES = {name: elementwise for name in _ELEMENTWISE}
RULES.update({
    "_assert_tensor_metadata": lambda rw, old: rw.env[old.args[0]],
    "transpose": transpose, "t": t, "permute": permute, "unsqueeze": unsqueeze, "squeeze": squeeze,
    "view": reshape, "reshape": reshape, "_unsafe_view": reshape, "flatten": reshape, "unflatten": reshape,
    "expand": expand, "broadcast_to": expand, "repeat_interleave": repeat_interleave, "index": index,
    "split": split, "split_with_sizes": split, "chunk": split, "getitem": getitem,
    "max": max_min, "min": max_min,
    "slice": slice_, "narrow": narrow, "index_select": index_select, "select": select, "cat": cat, "stack": stack,
    "softmax": softmax, "_softmax": softmax, "_safe_softmax": softmax, "log_softmax": softmax,
    "_log_softmax": softmax,
    "sum": reduction, "mean": reduction, "amax": reduction, "amin": reduction,
    "layer_norm": norm, "rms_norm": norm,
    "matmul": activation_matmul, "bmm": activation_matmul, "baddbmm": activation_matmul,
    "scaled_dot_product_attention": sdpa,
    "cross_entropy_loss": cross_entropy,
    "call_loss": eager_loss,
})

from threefold.passes.tp_rules_share import SHARE_RULES  # noqa: E402  (they use the helpers above)

RULES.update(SHARE_RULES)
