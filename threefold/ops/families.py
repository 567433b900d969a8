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
# families whose ops move values between positions along a dim (a loss denominator read through
# one of them counts positions its own way: passes/cp_denominator.py)
MOVING_FAMILIES = ("slicing", "pad", "join", "scan", "sort", "conv", "pool", "matmul")   # keys of FAMILIES


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


# -- named sets: the questions passes ask, answered here from the families above -------------
# Each was a pass's own list. Where two passes' sets differ, the difference is written here,
# so it stays visible in one place (and can be closed in one place).

# small sets the questions below are built from
PICKS = frozenset({"getitem"})                        # operator.getitem: one output of a tuple-valued op
METADATA_CHECKS = frozenset({"_assert_tensor_metadata"})   # checks a tensor's dtype/shape, computes nothing
SHAPE_QUERIES = frozenset({"sym_size", "sym_numel"})          # a tensor's sizes as symbolic ints
SPLITS = frozenset({"split", "split_with_sizes", "chunk"})   # one dim cut into pieces, each read by a getitem
TRANSPOSES = frozenset({"t", "transpose", "permute", "numpy_T"})     # swap or reorder dims
UNIT_DIMS = frozenset({"squeeze", "unsqueeze"})       # add or drop a size-1 dim
SCALINGS = frozenset({"mul", "div"})                  # times or over (a constant: a scale)
DROPOUTS = frozenset({"dropout", "tp_dropout"})        # dropout(x, p, train): as traced, or tp's (runtime/tp_ops.py)
GEMMS = MATMULS - {"outer", "einsum"}                  # one (batched) matrix product per call
GROUPED_MATMULS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})   # rows by group x its weight
CONV_CALLS = CONVS - {"_convolution"}                 # the conv calls a model makes (not ATen's internal one)
CROSS_ENTROPIES = frozenset({"cross_entropy", "cross_entropy_loss"})     # F.cross_entropy, as traced
# the loss over a row of logits under tp (runtime/tp_ops.py): the vocabulary split across ranks
VOCAB_PARALLEL_CROSS_ENTROPIES = LOSSES & {"vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_full"}
# the tensor-parallel collectives runtime/tp_ops.py applies to a value as a whole
TP_WHOLE_VALUE_OPS = frozenset({"f", "g", "scatter", "gather", "all_gather_seq", "scatter_blocks", "gather_blocks"})
# element-wise ops whose operands broadcast (compiler/seq_birth.py cuts a whole-length operand
# of one met at the torch level, `x + self.pos`, where `__add__` / `__radd__` stand for add)
ELEMENTWISE_BINARY = frozenset({"add", "sub", "mul", "div", "where", "maximum", "minimum"})
# a constant of another tensor's shape (and dtype): reads nothing else of it
CONSTANT_LIKE = LIKE_FACTORIES & {"empty_like", "zeros_like", "ones_like", "full_like"}

# ops that read or write a tensor at the positions an index tensor gives (and, of them, those
# that take a tensor of positions as the first argument's own rows: the batch-row rules)
INDEXING = frozenset({"index", "_unsafe_index", "index_select", "gather", "take_along_dim", "scatter", "scatter_",
                      "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add", "index_add_",
                      "index_copy", "index_copy_", "index_fill", "index_fill_", "index_reduce", "index_reduce_",
                      "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"})
POSITION_INDEXING = INDEXING & {"index", "index_put", "index_put_", "index_add", "index_add_", "index_copy",
                                "index_copy_", "index_select", "_unsafe_index"}
# products whose leading dims are batch dims (tp padding of a sharded leading dim)
BATCHED_PRODUCTS = (GEMMS & {"matmul", "bmm", "baddbmm"}) | {"scaled_dot_product_attention"}

# ops that place values by a position tensor: given one computed from a rank's own rows, it
# is a global position, meaningless on another rank (ep's expert regions refuse them)
PLACE_BY_POSITION = INDEXING | frozenset({"embedding", "embedding_bag", "nonzero", "argwhere", "sort", "argsort",
                                          "take", "put", "put_"})

# factories whose value is the same at every position: one of the local length made in forward
# is the whole-length one cut to this rank's blocks under cp (passes/cp_factories.py)
UNIFORM_FACTORIES = frozenset({"ones", "zeros", "full", "empty", "new_ones", "new_zeros", "new_full", "new_empty"})

# ops that read only their tensor arguments' shapes (and dtypes): the batch-row rules
READS_SHAPE_ONLY = CONSTANT_LIKE | (FACTORIES & {"new_empty", "new_zeros", "new_ones", "new_full", "scalar_tensor"})

# ops whose one output shares its first argument's storage: a write through it is a write to
# the argument (what in-place tracking follows: codegen, batch_coupling)
ALIASING = VIEWS | (DIM_MOVES - {"swapaxes", "expand_as", "broadcast_to"}) | {"slice", "select", "narrow"} \
    | {"as_strided", "diagonal", "alias", "detach"}
# views of pieces or windows of the argument (codegen's in-place check follows them;
# batch_coupling's buffer tracking does not yet)
ALIASING_PIECES = SPLITS | {"unbind", "unfold"}

# ops whose output holds the argument's entries re-indexed, so a batch row can be followed
# through them (the batch-row rules: passes/row_rules.py)
ROW_VIEWS = ALIASING | COPIES | {"reshape_as", "swapaxes", "expand_as", "repeat", "view_copy", "numpy_T", "unfold",
                                 "pixel_shuffle"}

# ops the cost model counts no arithmetic for (passes/cost.py), and those of them that still
# read and write their bytes (the rest move none)
NO_ARITHMETIC = VIEWS | COPIES | PICKS | (DIM_MOVES - {"swapaxes", "broadcast_to"}) \
    | (SLICING - {"tensor_split"}) | JOINS | (REPEATS - {"tile"}) | {"embedding", "dropout"} \
    | {"arange", "ones", "zeros", "full", "empty", "scalar_tensor", "new_ones", "new_zeros"} \
    | {"ones_like", "zeros_like", "full_like"} | {"as_strided", "copy", "index", "gather", "triu", "tril"}
MOVES_BYTES = frozenset({"embedding", "cat", "index", "gather", "index_select", "repeat", "_to_copy", "clone", "copy",
                         "contiguous"})

# ops that move or copy dims without mixing entries along them (tensor-parallel padding:
# passes/tp_padding.py; reshape has its own math there)
LAYOUT_ONLY = RESHAPES | COPIES | PICKS | METADATA_CHECKS | (DIM_MOVES - {"swapaxes", "expand_as", "movedim"}) \
    | {"flatten", "unflatten", "dropout", "native_dropout"}

# ops that may run on a sequence shard whose last rank holds padding rows: each row alone
# (passes/tp_padding.py; the eager loss `call_loss` gathers and cuts its inputs itself)
ROW_WISE = (LAYER_NORMS - {"_fused_rms_norm"}) | {"dropout", "native_dropout"} \
    | (COPIES - {"to", "type_as", "lift_fresh_copy"}) | PICKS | {"call_loss"}

# ops through which a parameter is still "the same matrix": views, casts, and the
# tensor-parallel collectives (compiler/param_roles.py)
SAME_MATRIX = RESHAPES | COPIES | PICKS | SPLITS | {"unbind"} | TP_WHOLE_VALUE_OPS \
    | {"t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "numpy_T", "_reshape_alias", "view_as",
       "dequantize"}

# ops that set a dtype themselves: an operand's dtype differing from the output's is the op
# (compiler/autocast_regions.py)
DTYPE_SETTERS = CASTS | METADATA_CHECKS | (COPIES - {"contiguous"}) | {"copy_", "copy"} | CONSTANT_LIKE

# views that keep a size-1 or same-size value's positions (arange through casts: row_index_rules)
SIZE_ONE_VIEWS = (COPIES - {"contiguous", "type_as", "lift_fresh_copy"}) | {"unsqueeze", "expand", "view", "reshape"}

# ops between a fused projection and its slices that keep the output's last dim (tp patterns)
KEEPS_LAST_DIM = (COPIES - {"detach", "lift_fresh_copy"}) | RESHAPES | {"add", "dropout"}
# ops between an unflatten and a select/unbind of its new dim that keep that dim (tp patterns)
MOVES_DIMS_APART = frozenset({"unsqueeze", "transpose", "squeeze", "contiguous", "clone", "permute"})

# the random ops passes/random_ops.py seeds per microbatch (RANDOM's dropout is seeded as
# DROPOUTS)
SEEDED_RANDOM = (RANDOM - {"dropout"}) | {"feature_dropout", "alpha_dropout", "feature_alpha_dropout",
                                                         "rrelu", "rrelu_with_noise"}

# ops with a train-mode argument (`training` / `train` in their schema) that
# passes/random_ops.py turns into the module's mode, so pm.eval() reaches them
TRAIN_FLAGGED = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "native_dropout",
                           "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "rrelu", "rrelu_with_noise"})

# how a loss op's reduction="mean" divides (passes/loss_form.py): by the targets it counts
# (ignore_index left out), or by every element
TARGET_COUNTED_LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"})
ELEMENT_MEAN_LOSSES = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                                 "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div",
                                 "hinge_embedding_loss", "margin_ranking_loss", "poisson_nll_loss"})

# integer arithmetic that keeps positions positions (arange(T) // 2: the batch-row rules)
POSITION_ARITHMETIC = frozenset({"floor_divide", "div", "remainder", "add", "sub", "mul", "fmod"})

# ops an arange passes on its way to index an input (views, casts, + 0): cp reads the arange as
# that input's positions (passes/context_parallel.py)
ARANGE_TO_INDEX = VIEWS | COPIES | frozenset({"unsqueeze", "expand", "add", "sub"})

# cp's permutation rules (passes/cp_rules/permutations.py): the indexing ops a routing sort's
# rows meet, and the ops that keep row numbers row numbers (arithmetic, casts, reshapes)
PERMUTATION_INDEXING = INDEXING & {"index", "index_select", "index_add", "index_put", "index_put_", "index_add_",
                                   "gather"}
KEEPS_ROW_NUMBERS = POSITION_ARITHMETIC | (COPIES - {"type_as", "lift_fresh_copy"}) | RESHAPES | {"flatten"}

# -- the batch-row rules' (passes/row_rules.py) wider reach: ops of a family above that only
# those rules know yet (the tp and cp rules would need a decision for each first) ----------
MORE_REDUCTIONS = frozenset({"count_nonzero", "nanmean", "aminmax", "median", "nanmedian"})
MORE_MATMULS = frozenset({"addbmm", "dot", "mv", "vdot"})
MORE_CONVS = frozenset({"conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# ops that mix entries along one dim only, each row of the other dims alone
ALONG_ONE_DIM = SCANS | SOFTMAXES | (SORTS - {"msort"}) | {"mode", "glu", "flip", "roll"}
ROW_REDUCTIONS = REDUCTIONS | MORE_REDUCTIONS
ROW_MATMULS = GEMMS | MORE_MATMULS     # (einsum has a rule of its own)
ROW_CONVS = CONVS | MORE_CONVS
ROW_LOSSES = TARGET_COUNTED_LOSSES | ELEMENT_MEAN_LOSSES | {"cosine_embedding_loss", "multilabel_margin_loss",
                                                           "multi_margin_loss"}
