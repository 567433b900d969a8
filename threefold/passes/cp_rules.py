"""The sequence placement under context parallelism, propagated over the graph, op by op.

Each value is one of: not along the sequence (None: parameters, constants, values of them),
split along the sequence at dim d (`Seq(d)`: this rank holds its positions' rows there; a
dim that merges the sequence with its neighbours, [b*s, h] after a flatten, counts too), or
a partial sum over this rank's tokens (`PARTIAL`: the loss numerator, summed over the batch
axes by the runtime). A rule maps an op's input placements to its output's; an op that
would mix positions (a reduction, cumsum, slice or contraction along the sequence; a
per-position constant meeting a split value) has none, and is a PlanError naming the op,
its module and the fix. Rules are by family: pointwise (ATen's pointwise tag), views,
reductions with a dim, norms, matmuls, embeddings, losses, the runtime's tp and cp ops.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from math import prod

import torch
import torch.fx as fx

from threefold.compiler.program import tf
from threefold.errors import PlanError


@dataclass(frozen=True)
class Seq:
    dim: int


PARTIAL = "partial"


def op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def check_sequence(gm: fx.GraphModule, stage, fallbacks: list | None = None) -> dict:
    """Every node's sequence placement (name -> Seq | PARTIAL | None); an op that would mix
    positions runs on the all-gathered sequence (passes/cp_fallback.py, appended to
    `fallbacks`) where its family allows, else a PlanError."""
    from threefold.passes.cp_fallback import gather_around
    fallbacks = [] if fallbacks is None else fallbacks
    seq_dims = stage.seq_dims or []
    state: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            i = tf(node).get("input_index")
            d = seq_dims[i] if tf(node).get("kind") == "input" and i is not None and i < len(seq_dims) else None
            state[node] = Seq(d) if d is not None else None
        elif node.op == "output":
            for out in node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]:
                s = state.get(out)
                if stage.has_loss and isinstance(s, Seq):
                    _fail(node, stage, "the loss is not reduced over the sequence")
        elif node.op == "call_function":
            ins = [state.get(a) for a in node.all_input_nodes]
            if op_name(node) == "shard_seq":   # the all-gather fallback's cut back to this rank's blocks
                state[node] = Seq(node.args[1])
                continue
            if all(s is None for s in ins):
                state[node] = None if op_name(node) != "positions" else Seq(0)
                continue
            try:
                state[node] = _rule(node, state, stage)
            except PlanError as exc:
                state[node] = gather_around(node, state, stage, str(exc), fallbacks, op_name(node), Seq)
    return {n.name: s for n, s in state.items()}


def _fail(node, stage, why: str):
    module = tf(node).get("module") or "<top>"
    raise PlanError(f"cp={stage.plan.cp}: {op_name(node)} at {module} {why}; context parallelism cannot "
                    "split the sequence here: use cp=1 for this model (or rewrite the op position-wise)")


def _st(state, x):
    return state.get(x) if isinstance(x, fx.Node) else None


def _norm(d, rank):
    return d % rank if rank else d


_POINTWISE_EXTRA = {"dropout", "where", "masked_fill", "_to_copy", "to", "clone", "contiguous", "alias",
                    "detach", "type_as", "lift_fresh_copy", "copy", "fill", "zeros_like", "ones_like",
                    "empty_like", "full_like", "f", "g", "tp_dropout", "native_dropout"}
_VIEWS = {"view", "_unsafe_view", "reshape", "flatten", "unflatten", "view_as"}
_DIM_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "logsumexp", "argmax", "argmin",
               "norm", "prod", "any", "all", "var_mean", "std_mean"}
_DIM_SCAN = {"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod", "cummax", "cummin",
             "logcumsumexp", "sort", "argsort", "topk"}
_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward", "mse_loss", "l1_loss",
           "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
           "kl_div", "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_full"}


def _rule(node: fx.Node, state: dict, stage):
    name = op_name(node)
    out = _val(node)
    args = node.args
    first = args[0] if args else None
    s0 = _st(state, first)
    if node.target is operator.getitem:
        s = state.get(first)
        return s[args[1]] if isinstance(s, tuple) else s
    if name == "_assert_tensor_metadata":
        return None
    if any(_st(state, a) == PARTIAL for a in node.all_input_nodes):
        if name in ("mul", "div", "neg", "add", "sub", "_to_copy", "to", "clone", "alias", "detach",
                    "view", "reshape", "squeeze", "unsqueeze", "_unsafe_view") and sum(
                _st(state, a) == PARTIAL for a in node.all_input_nodes) == 1 and not any(
                isinstance(_st(state, a), Seq) for a in node.all_input_nodes):
            if name in ("add", "sub") and any(isinstance(a, fx.Node) and _st(state, a) is None
                                              and _val(a) is not None for a in args[:2]):
                _fail(node, stage, "adds a whole value to a per-rank partial loss")
            return PARTIAL
        _fail(node, stage, "reads a partial (per-rank) loss sum")
    if name == "ring_attention":
        return Seq(out.dim() - 2)
    if name == "key_bias":   # a key-side padding mask: split along its last (key) dim
        if any(_st(state, a) != Seq(_val(a).dim() - 1) for a in node.all_input_nodes):
            _fail(node, stage, "takes a mask that is not split along its key dim")
        return Seq(out.dim() - 1)
    if name == "causal_conv1d":
        if s0 is None or s0.dim != _val(first).dim() - 1:
            _fail(node, stage, "convolves along a dim that is not the sequence")
        return s0
    if name in _LOSSES:
        return _loss(node, state, stage)
    if isinstance(node.target, torch._ops.OpOverload) and (
            torch.Tag.pointwise in node.target.tags) or name in _POINTWISE_EXTRA:
        return _pointwise(node, state, stage)
    if name in ("expand", "expand_as"):
        return Seq(s0.dim + out.dim() - _val(first).dim())
    if name in _VIEWS:
        return _view(node, _val(first).shape, s0.dim, out.shape, stage)
    if name == "unsqueeze":
        d = _norm(args[1], out.dim())
        return Seq(s0.dim + (1 if d <= s0.dim else 0))
    if name == "squeeze":
        shape = _val(first).shape
        dims = args[1] if len(args) > 1 else [i for i, n in enumerate(shape) if n == 1]
        dims = [dims] if isinstance(dims, int) else dims
        dims = [_norm(d, len(shape)) for d in dims if shape[_norm(d, len(shape))] == 1]
        return Seq(s0.dim - sum(d < s0.dim for d in dims))
    if name in ("transpose", "swapaxes"):
        r = out.dim()
        a, b = _norm(args[1], r), _norm(args[2], r)
        return Seq({a: b, b: a}.get(s0.dim, s0.dim))
    if name == "t":
        return Seq(1 - s0.dim) if out.dim() == 2 else s0
    if name == "permute":
        perm = [_norm(d, out.dim()) for d in args[1]]
        return Seq(perm.index(s0.dim))
    if name == "index":
        return _index(node, state, stage)
    if name in ("slice", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind", "index_select"):
        return _slicing(node, state, stage)
    if name in ("cat", "stack"):
        return _cat(node, state, stage)
    if name in _DIM_REDUCE or name in _DIM_SCAN:
        return _reduce(node, state, stage)
    if name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"):
        shape = args[1]
        if s0 is None or s0.dim >= _val(first).dim() - len(shape):
            _fail(node, stage, "normalizes over the sequence")
        return (s0, s0, s0) if name == "native_layer_norm" else s0
    if name in ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm"):
        return _matmul(node, state, stage)
    if name in ("embedding", "vocab_parallel_embedding"):
        idx = args[1]
        si = _st(state, idx)
        if _st(state, args[0]) is not None or si is None:
            _fail(node, stage, "looks up a table that is split along the sequence")
        return Seq(si.dim)
    if name in ("scatter", "gather", "scatter_blocks", "gather_blocks", "reduce_scatter", "all_gather_seq"):
        d = _norm(args[1], out.dim())
        if s0 is not None and d == s0.dim:
            _fail(node, stage, "splits or gathers along the sequence over tp")
        return s0
    _fail(node, stage, "has no context-parallel rule (it may mix sequence positions)")


def _pointwise(node, state, stage):
    out = _val(node)
    r = out.dim() if isinstance(out, torch.Tensor) else 0
    dims = set()
    for a in list(node.args) + list(node.kwargs.values()):
        s = _st(state, a)
        if isinstance(s, Seq):
            dims.add(s.dim + r - _val(a).dim())
    if len(dims) != 1:
        _fail(node, stage, "combines values split along different dims")
    d = dims.pop()
    for a in list(node.args) + list(node.kwargs.values()):
        v = _val(a)
        if _st(state, a) is None and isinstance(v, torch.Tensor):
            i = d - (r - v.dim())
            if i >= 0 and v.shape[i] != 1:
                _fail(node, stage, "combines the sequence with a value that varies per position but is "
                      "not computed from the inputs (a table sliced to the sequence length?)")
    return Seq(d)


def _view(node, shape_in, d, shape_out, stage):
    """The output dim that carries input dim d's positions as a digit of its index."""
    post = prod(shape_in[d + 1:])
    length = shape_in[d] * post
    for e in reversed(range(len(shape_out))):
        inner = prod(shape_out[e + 1:])
        if post % inner == 0 and (shape_out[e] * inner) % length == 0:
            return Seq(e)
    _fail(node, stage, f"reshapes {tuple(shape_in)} -> {tuple(shape_out)} across the sequence dim {d}")


def _slicing(node, state, stage):
    name, args = op_name(node), node.args
    s0 = _st(state, args[0])
    src = _val(args[0])
    if name == "index_select":
        d = _norm(args[1], src.dim())
        if s0 is None or d == s0.dim or _st(state, args[2]) is not None:
            _fail(node, stage, "indexes along the sequence")
        return s0
    if name in ("unbind",):
        d = _norm(args[1] if len(args) > 1 else 0, src.dim())
    elif name in ("split", "split_with_sizes", "chunk"):
        d = _norm(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), src.dim())
    else:
        d = _norm(args[1] if len(args) > 1 else 0, src.dim())
    if d == s0.dim:
        if name == "slice" and _is_whole_slice(args, src, d):
            return s0
        _fail(node, stage, f"slices along the sequence (dim {d})")
    if name in ("select", "unbind"):
        s = Seq(s0.dim - (1 if d < s0.dim else 0))
        return tuple(s for _ in _val(node)) if name == "unbind" else s
    if name in ("split", "split_with_sizes", "chunk"):
        return tuple(s0 for _ in _val(node))
    return s0


def _index(node, state, stage):
    """x[..., idx, ...] with x split along the sequence at d: exact when the index at d is the
    local identity, arange(n) (HF's padding mask read as mask[batch_idx, kv_idx]; the cp pass
    keeps such an arange local), and no other index varies along it."""
    from threefold.passes.cp_masks import evaluate
    x, indices = node.args[0], list(node.args[1])
    s0, out = _st(state, x), _val(node)
    n = stage.seq_len
    if not isinstance(s0, Seq) or s0.dim >= len(indices) or not isinstance(indices[s0.dim], fx.Node) or any(
            _st(state, i) is not None for i in indices if isinstance(i, fx.Node)):
        _fail(node, stage, "indexes along the sequence")
    try:
        v = evaluate(indices[s0.dim], stage)
    except Exception:
        _fail(node, stage, "indexes along the sequence with an index it cannot read")
    varying = [e for e in range(v.dim()) if v.shape[e] == n]
    if len(varying) != 1 or not torch.equal(
            v, torch.arange(n).view([n if e == varying[0] else 1 for e in range(v.dim())]).expand(v.shape)):
        _fail(node, stage, "indexes along the sequence (not with its own positions)")
    given = [i for i, a in enumerate(indices) if a is not None]
    shapes = [_val(indices[i]).shape for i in given]
    bshape = torch.broadcast_shapes(*shapes)
    e = varying[0] + len(bshape) - v.dim()
    if any(len(sh) - len(bshape) + e >= 0 and sh[len(sh) - len(bshape) + e] != 1
           for i, sh in zip(given, shapes) if i != s0.dim):
        _fail(node, stage, "indexes along the sequence with indices that vary along it")
    adjacent = given == list(range(given[0], given[-1] + 1))
    return Seq((given[0] if adjacent else 0) + e)


def _is_whole_slice(args, src, d) -> bool:
    start = args[2] if len(args) > 2 else 0
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    return (start in (0, None)) and (end is None or end >= src.shape[d]) and step == 1


def _cat(node, state, stage):
    tensors = node.args[0]
    rank_in = _val(tensors[0]).dim()
    d = _norm(node.args[1] if len(node.args) > 1 else 0, rank_in + (op_name(node) == "stack"))
    dims = {_st(state, t).dim for t in tensors if isinstance(_st(state, t), Seq)}
    if len(dims) != 1 or any(_st(state, t) is None for t in tensors):
        _fail(node, stage, "joins values split along the sequence with others")
    s = dims.pop()
    if op_name(node) == "cat":
        if d == s:
            _fail(node, stage, "concatenates along the sequence")
        return Seq(s)
    return Seq(s + (1 if d <= s else 0))


def _reduce(node, state, stage):
    name, args = op_name(node), node.args
    s0 = _st(state, args[0])
    src = _val(args[0])
    if name in _DIM_SCAN:
        d = _norm(args[1] if len(args) > 1 else node.kwargs.get("dim", -1), src.dim())
        if d == s0.dim:
            _fail(node, stage, f"runs along the sequence (dim {d})")
        return tuple(s0 for _ in _val(node)) if isinstance(_val(node), (tuple, list)) else s0
    dims = args[1] if len(args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        if name in ("sum", "mean"):
            return PARTIAL if _loss_path(node) else _fail(node, stage, "sums over every position")
        _fail(node, stage, "reduces over every position")
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [_norm(d, src.dim()) for d in dims]
    if s0.dim in dims:
        if name in ("sum", "mean") and len(dims) == src.dim() and _loss_path(node):
            return PARTIAL
        _fail(node, stage, f"reduces along the sequence (dim {s0.dim})")
    keep = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
    s = Seq(s0.dim if keep else s0.dim - sum(d < s0.dim for d in dims))
    return tuple(s for _ in _val(node)) if isinstance(_val(node), (tuple, list)) else s


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


def _matmul(node, state, stage):
    name, args = op_name(node), node.args
    if name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    sa, sb = _st(state, a), _st(state, b)
    out = _val(node)
    ra = _val(a).dim()
    if name == "linear" or sb is None:
        if sa is None or (ra > 1 and sa.dim == ra - 1) or (name != "linear" and ra == 1):
            _fail(node, stage, "contracts over the sequence")
        return Seq(sa.dim + out.dim() - ra)
    rb = _val(b).dim()
    if sa is None:
        if sb.dim == rb - 2 or rb == 1:
            _fail(node, stage, "contracts over the sequence")
        if sb.dim == rb - 1:
            return Seq(out.dim() - 1)
        return Seq(sb.dim + out.dim() - rb)
    # both split: only along a shared batch dim
    if sa.dim < ra - 2 and sb.dim < rb - 2 and sa.dim - ra == sb.dim - rb:
        return Seq(sa.dim + out.dim() - ra)
    _fail(node, stage, "contracts over the sequence (attention not recognised as such?)")


def _loss(node, state, stage):
    name, args = op_name(node), node.args
    s0 = _st(state, args[0])
    if name.startswith("vocab_parallel_cross_entropy"):
        reduction = args[5] if name.endswith("_full") and len(args) > 5 else node.kwargs.get("reduction", 1)
    else:
        from threefold.passes.loss_form import _arg, _reduction_index
        reduction = _arg(node, _reduction_index(node), "reduction", 1)
    if s0 is not None and name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd") and _val(args[0]).dim() > 1 \
            and s0.dim == 1:
        _fail(node, stage, "takes classes along the sequence dim")
    if reduction == 0:   # none: per position
        if s0 is None:
            return _st(state, args[1])
        if name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd") and _val(args[0]).dim() > 1 and s0.dim > 1:
            return Seq(s0.dim - 1)
        return s0
    return PARTIAL
