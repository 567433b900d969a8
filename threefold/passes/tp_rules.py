"""Per-ATen-op sharding rules for the tensor-parallel pass (a table keyed by op name).

Each rule gets the rewriter and the old node (at least one input is not plainly
replicated), emits the local op(s) and returns the new node, whose placement it sets.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from threefold.compiler.cost import op_name
from threefold.errors import PlanError
from threefold.passes.tp_placement import Partial, Replicate, Shard, reshape_groups, scaled_size
from threefold.runtime import tp_ops
from threefold.runtime.tp_ops import TP

aten = torch.ops.aten


def _rank(v) -> int:
    return len(v.shape)


def _shard_of(rw, node) -> Shard | None:
    p = rw.place[node]
    return p if isinstance(p, Shard) else None


def _fail(rw, why: str):
    raise PlanError(f"tp={rw.t}: {rw._where()} {why}; use tp=1 for this model or restructure it")


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

    def fix(a):
        if not isinstance(a, fx.Node) or not isinstance(rw.place[a], Replicate):
            return a
        k = shard.dim - (out_rank - _rank(rw.val[a]))
        if k >= 0 and rw.val[a].shape[k] != 1:
            if shard.blocks:
                _fail(rw, "mixes a block-sharded value with a replicated one")
            sliced.add(a)
            return rw.scatter(a, k, seq=shard.seq)
        return a
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
    """view/reshape: the sharded input dim must lead its group of merged/split dims; the
    output dim that leads the matching group is sharded, its literal size rewritten."""
    x = rw.env[old.args[0]]
    s = rw.place[x]
    if isinstance(s, Replicate) and s.gathered:
        return rw.copy_node(old, val=None, place=s)
    src_global = list(old.args[0].meta["val"].shape)
    src_local = list(rw.val[x].shape)
    dst_global = list(old.meta["val"].shape)
    groups = reshape_groups(src_global, dst_global)
    for gi, gj in groups:
        if s.dim in gi:
            lead_in = next(i for i in gi if src_global[i] != 1)
            if lead_in != s.dim:
                if s.seq:  # a sequence shard can always be gathered back (GPT-2's x.view(-1, C));
                    # a plain gather (slice in backward) is right whatever reads the result
                    whole = rw._cached(("gather", x), lambda: rw.gather(x, s.dim))
                    return rw.emit(old.target, (whole,) + tuple(rw._map(old.args[1:])),
                                   rw._map(old.kwargs), place=rw.place[whole])
                _fail(rw, f"reshapes {src_global} -> {dst_global} with sharded dim {s.dim} not leading its group")
            if not gj:
                _fail(rw, "reshapes the sharded dim away")
            lead_out = next((j for j in gj if dst_global[j] != 1), gj[0])
            if s.blocks and (len(gi) != 1 or len(gj) != 1):
                _fail(rw, "reshapes a block-sharded dim")
            dst_local = list(dst_global)
            dst_local[lead_out] = scaled_size(dst_global[lead_out], src_local[s.dim], src_global[s.dim],
                                              f"{rw._where()} (reshape {src_global} -> {dst_global})", rw.t)
            break
    else:
        _fail(rw, "reshapes a sharded value in a way threefold cannot follow")
    if op_name(old) == "flatten":  # same layout as a reshape to the flattened shape
        return rw.emit(aten.reshape.default, (x, dst_local), place=s.moved(lead_out))
    args = (x, dst_local) + tuple(rw._map(old.args[2:]))
    return rw.emit(old.target, args, rw._map(old.kwargs), place=s.moved(lead_out))


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
    x = rw.env[old.args[0]]
    s = _shard_of(rw, x)
    n = _rank(rw.val[x])
    dim = (old.args[1] if len(old.args) > 1 else 0) % n
    if dim == s.dim:
        start = old.args[2] if len(old.args) > 2 else None
        end = old.args[3] if len(old.args) > 3 else None
        step = old.args[4] if len(old.args) > 4 else 1
        full = old.args[0].meta["val"].shape[dim]
        if (start or 0) != 0 or step != 1 or (end is not None and end < full):
            _fail(rw, "slices the sharded dim")
        return x
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
    fixed = [a if isinstance(rw.place[a], Shard) else rw.scatter(a, s.dim, s.seq) for a in tensors]
    return rw.emit(old.target, (fixed,) + tuple(rw._map(old.args[1:])), rw._map(old.kwargs), place=s)


def stack(rw, old):
    tensors = [rw.env[a] for a in old.args[0]]
    n = _rank(rw.val[tensors[0]])
    dim = (old.args[1] if len(old.args) > 1 else 0) % (n + 1)
    shards = {rw.place[a] for a in tensors if isinstance(rw.place[a], Shard)}
    if len(shards) != 1:
        _fail(rw, "stacks values sharded differently")
    s = shards.pop()
    fixed = [a if isinstance(rw.place[a], Shard) else rw.scatter(a, s.dim, s.seq) for a in tensors]
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


def activation_matmul(rw, old):
    """matmul/bmm of two activations (attention): shards on a batch dim must agree."""
    a, b = rw.env[old.args[0]], rw.env[old.args[1]]
    ra, rb = _rank(rw.val[a]), _rank(rw.val[b])
    out_rank = _rank(old.meta["val"])
    sa, sb = _shard_of(rw, a), _shard_of(rw, b)
    if sa and sb and sa.dim == ra - 1 and sb.dim == rb - 2:
        return rw.g(rw.copy_node(old, args=(a, b), place=Partial()))
    batch = None
    for x, s, r in ((a, sa, ra), (b, sb, rb)):
        if s is not None:
            if s.dim >= r - 2:
                _fail(rw, f"multiplies along a sharded matrix dim ({s})")
            cand = s.dim + out_rank - r
            if batch is not None and batch != cand:
                _fail(rw, "multiplies values sharded on different batch dims")
            batch = cand
    def fix(x, r):
        k = batch - (out_rank - r)
        if isinstance(rw.place[x], Replicate) and k >= 0 and rw.val[x].shape[k] != 1:
            return rw.scatter(x, k)
        return x
    return rw.copy_node(old, args=(fix(a, ra), fix(b, rb)) + tuple(rw._map(old.args[2:])),
                        place=Shard(batch))


def sdpa(rw, old):
    q, k, v = (rw.env[a] for a in old.args[:3])
    shards = {rw.place[x] for x in (q, k, v) if isinstance(rw.place[x], Shard)}
    if len(shards) != 1 or next(iter(shards)).dim != 1:
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
    if s is None or s.dim != _rank(rw.val[logits]) - 1 or _rank(rw.val[logits]) != 2:
        _fail(rw, "computes cross-entropy over logits not sharded on the vocabulary of [N, V]")
    if weight is not None or reduction_ != 1 or smoothing:
        _fail(rw, "uses class weights, label smoothing or a reduction other than mean")
    target = rw.to_replicated(target)
    vocab = old.args[0].meta["val"].shape[-1]
    n = rw.val[logits].shape[0]
    out = torch.empty((), dtype=old.meta["val"].dtype, device="meta")
    node = rw.emit(tp_ops.vocab_parallel_cross_entropy, (logits, target, ignore, vocab, TP),
                   place=Replicate(), val=out,
                   collective={"kind": "all_reduce", "group": "tp", "phase": "forward", "elements": n,
                               "count": 2})
    return node


_ELEMENTWISE = [
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
    "silu", "gelu", "relu", "erf", "abs", "masked_fill", "where", "_to_copy", "to", "type_as",
    "clone", "contiguous", "alias", "detach", "dropout", "reciprocal", "bitwise_not", "eq", "ne",
    "lt", "gt", "le", "ge", "logical_not", "logical_and", "logical_or", "clamp", "minimum",
    "maximum", "sin", "cos", "square", "lift_fresh_copy", "lerp", "fill", "zeros_like",
    "ones_like", "full_like", "softplus", "leaky_relu", "hardtanh", "log1p", "expm1",
]

RULES = {name: elementwise for name in _ELEMENTWISE}
RULES.update({
    "_assert_tensor_metadata": lambda rw, old: rw.env[old.args[0]],
    "transpose": transpose, "t": t, "permute": permute, "unsqueeze": unsqueeze, "squeeze": squeeze,
    "view": reshape, "reshape": reshape, "_unsafe_view": reshape, "flatten": reshape, "expand": expand,
    "split": split, "split_with_sizes": split, "chunk": split, "getitem": getitem,
    "slice": slice_, "select": select, "cat": cat, "stack": stack,
    "softmax": softmax, "_softmax": softmax, "_safe_softmax": softmax, "log_softmax": softmax,
    "_log_softmax": softmax,
    "sum": reduction, "mean": reduction, "amax": reduction, "amin": reduction,
    "layer_norm": norm, "rms_norm": norm,
    "matmul": activation_matmul, "bmm": activation_matmul,
    "scaled_dot_product_attention": sdpa,
    "cross_entropy_loss": cross_entropy,
})
