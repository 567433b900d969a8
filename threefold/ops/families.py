"""Op families, declared once: every pass that asks "is this a view / a reduction / a cast"
reads it here, keyed by the op's overload packet name (`aten.topk.default` -> "topk"; a
runtime function such as `cp_ops.ring_attention` -> its __name__).

Arguments are read by name from the op's schema (`args_of`), never by position: topk's
second argument is k, not dim, and norm's is p.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch
import torch.fx as fx


def op_name(node_or_target) -> str:
    """The overload packet's name ("topk" for aten.topk.default), or a function's __name__."""
    t = node_or_target.target if isinstance(node_or_target, fx.Node) else node_or_target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


@lru_cache(maxsize=None)
def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@lru_cache(maxsize=None)
def _schema_args(op) -> tuple:
    """(name, kwarg_only, default) per argument of an ATen overload (the schema, read once)."""
    return tuple((a.name, a.kwarg_only, a.default_value if a.has_default_value() else None)
                 for a in op._schema.arguments)


def args_of(node: fx.Node) -> dict:
    """A call's arguments by name, defaults filled in: from the ATen schema, or from a Python
    function's signature (the runtime's ops). Unknown names are absent."""
    t = node.target
    out = {}
    if isinstance(t, torch._ops.OpOverload):
        for i, (name, kwarg_only, default) in enumerate(_schema_args(t)):
            if i < len(node.args) and not kwarg_only:
                out[name] = node.args[i]
            elif name in node.kwargs:
                out[name] = node.kwargs[name]
            else:
                out[name] = list(default) if isinstance(default, list) else default   # a fresh list per call
        return out
    sig = _signature(t) if callable(t) else None
    if sig is None:
        return dict(node.kwargs)
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return dict(node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


# -- families (one name may be in one family only) -------------------------------------------

CASTS = frozenset({"_to_copy", "to", "type_as"})
COPIES = CASTS | {"clone", "contiguous", "alias", "detach", "lift_fresh_copy"}   # the same values, maybe cast
LIKE_FACTORIES = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "fill", "rand_like",
                            "randn_like", "randint_like"})
FACTORIES = frozenset({"arange", "zeros", "ones", "full", "empty", "empty_strided", "scalar_tensor", "tensor",
                       "new_zeros", "new_ones", "new_full", "new_empty", "linspace", "eye", "tril_indices",
                       "triu_indices"})
RANDOM = frozenset({"dropout", "native_dropout", "bernoulli", "rand", "randn", "randint", "randperm",
                    "multinomial", "normal", "uniform", "exponential", "rand_like", "randn_like", "randint_like"})
RESHAPES = frozenset({"view", "reshape", "_unsafe_view"})
VIEWS = RESHAPES | {"flatten", "unflatten", "view_as"}
DIM_MOVES = frozenset({"transpose", "swapaxes", "t", "permute", "unsqueeze", "squeeze", "expand", "expand_as",
                       "broadcast_to", "movedim"})
SLICING = frozenset({"slice", "narrow", "select", "index_select", "split", "split_with_sizes", "chunk", "unbind",
                     "tensor_split"})
JOINS = frozenset({"cat", "stack"})
REPEATS = frozenset({"repeat", "repeat_interleave", "tile"})
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "logsumexp", "argmax", "argmin",
                        "norm", "linalg_vector_norm", "prod", "any", "all", "var_mean", "std_mean", "nansum"})
SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
SCANS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"})
SORTS = frozenset({"sort", "argsort", "topk", "msort", "kthvalue"})
LAYER_NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"})
MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "outer", "einsum"})
EMBEDDINGS = frozenset({"embedding", "vocab_parallel_embedding"})
LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward", "mse_loss", "l1_loss",
                    "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                    "kl_div", "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_full"})
CONVS = frozenset({"conv1d", "conv2d", "convolution", "_convolution"})
POOLS = frozenset({"avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "max_pool1d",
                   "max_pool2d"})
ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention"})
PADS = frozenset({"constant_pad_nd", "pad", "reflection_pad1d", "replication_pad1d", "reflection_pad2d",
                  "replication_pad2d"})
# pointwise ops ATen does not tag pointwise (or that fx shows by another name)
POINTWISE_UNTAGGED = frozenset({"where", "masked_fill", "dropout", "native_dropout", "f", "g", "tp_dropout"})

FAMILIES = {
    "copy": COPIES, "like": LIKE_FACTORIES, "factory": FACTORIES, "view": VIEWS, "dim_move": DIM_MOVES,
    "slicing": SLICING, "join": JOINS, "repeat": REPEATS, "reduction": REDUCTIONS, "softmax": SOFTMAXES,
    "scan": SCANS, "sort": SORTS, "layer_norm": LAYER_NORMS, "matmul": MATMULS, "embedding": EMBEDDINGS,
    "loss": LOSSES, "conv": CONVS, "pool": POOLS, "pad": PADS,
    "attention": ATTENTION,
}


def is_pointwise(node: fx.Node) -> bool:
    """ATen's pointwise tag, or one of the untagged pointwise ops."""
    t = node.target
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags) or op_name(node) in POINTWISE_UNTAGGED


def family(node_or_name) -> str | None:
    """The family an op belongs to ("pointwise" by ATen's tag), or None."""
    name = node_or_name if isinstance(node_or_name, str) else op_name(node_or_name)
    if isinstance(node_or_name, fx.Node) and is_pointwise(node_or_name):
        return "pointwise"                    # max.other is pointwise, max.dim a reduction
    for fam, names in FAMILIES.items():
        if name in names:
            return fam
    return "pointwise" if name in POINTWISE_UNTAGGED or (isinstance(node_or_name, str) and _tagged_pointwise(name)) \
        else None


@lru_cache(maxsize=None)
def _tagged_pointwise(name: str) -> bool:
    """An ATen packet with an overload tagged pointwise (by name, without a node: max.other is,
    and by name "max" is a reduction first, as FAMILIES says)."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "overloads"):
        return False
    tags = [torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads() if not o.endswith("out")]
    return any(tags)


@lru_cache(maxsize=None)
def pointwise_names() -> frozenset:
    """Every ATen op (out-of-place, by packet name) in the pointwise family: tagged by ATen,
    or listed untagged above (what `threefold ops` lists for the family)."""
    packets = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    tagged = {n for n in packets if not n.endswith("_") and not n.startswith("_foreach") and family(n) == "pointwise"}
    return frozenset(tagged | POINTWISE_UNTAGGED)
