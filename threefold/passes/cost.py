"""Per-node cost: forward FLOPs, bytes read and written, parameter and activation bytes.

Rules live in a table keyed by ATen op (packet name), as JAX keeps per-primitive rules. An
op without a rule is costed as elementwise over its output (a safe default for the many
pointwise and view ops); matmul-like and attention ops have explicit rules because they
dominate. FLOPs count a multiply-add as 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.ir.program import TensorMeta, compute_nodes, meta_of, tf
from threefold.ir.stages import Traced, copy_graph_module
from threefold.ops import families as fam
from threefold.ops.families import op_name   # (re-exported: passes import it from here)

aten = torch.ops.aten


@dataclass(frozen=True)
class NodeCost:
    flops: int = 0               # forward FLOPs
    bytes_read: int = 0
    bytes_written: int = 0
    param_bytes: int = 0         # bytes of parameters this node reads (first use only)
    saved_bytes: int = 0         # activation bytes autograd keeps for backward
    saved: tuple = ()            # (value name, bytes) behind saved_bytes, to dedupe per chunk
    # Backward FLOPs are twice the forward's; of those, a GEMM reading a parameter spends
    # one forward's worth on grad_weight = grad_out^T @ input: zero bubble's W. The rest
    # (grad_input, and every other op's backward) is B, the input gradients.
    weight_grad_flops: int = 0


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _tensor_metas(args) -> list[TensorMeta]:
    out = []
    for a in args:
        if isinstance(a, fx.Node):
            m = meta_of(a)
            if m is not None:
                out.append(m)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensor_metas(a))
    return out


def _out_metas(node: fx.Node) -> list[TensorMeta]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [TensorMeta.of(val)]
    if isinstance(val, (list, tuple)):
        return [TensorMeta.of(v) for v in val if isinstance(v, torch.Tensor)]
    return []


# --- FLOP rules: f(node, input metas, output metas) -> flops ------------------------------

def _matmul_flops(node, ins, outs):
    a = ins[0]  # (..., m, k) @ (..., k, n)
    k = a.shape[-1] if len(a.shape) >= 1 else 1
    return 2 * _numel(outs[0].shape) * k


def _linear_flops(node, ins, outs):
    # input (..., in), weight (out, in): 2 * tokens * in * out, plus the bias add
    w = ins[1]
    flops = 2 * _numel(outs[0].shape) * int(w.shape[-1])
    return flops + (_numel(outs[0].shape) if len(ins) > 2 else 0)


def _addmm_flops(node, ins, outs):
    # bias (n,), a (m, k), b (k, n)
    return 2 * _numel(outs[0].shape) * int(ins[1].shape[-1]) + _numel(outs[0].shape)


def _baddbmm_flops(node, ins, outs):
    return 2 * _numel(outs[0].shape) * int(ins[1].shape[-1]) + _numel(outs[0].shape)


def _sdpa_flops(node, ins, outs):
    q, k = ins[0], ins[1]
    # q (..., L, E), k (..., S, E), v (..., S, Ev): QK^T and PV, plus softmax (~5/elt)
    *batch, L, E = q.shape
    S = k.shape[-2]
    b = _numel(batch)
    ev = outs[0].shape[-1]
    return 2 * b * L * S * E + 2 * b * L * S * ev + 5 * b * L * S


def _ring_flops(node, ins, outs):
    """Ring attention (runtime/cp_ops.py): the local queries meet every rank's keys, cp times
    the local block; counted unmasked, as SDPA's rule counts causal attention."""
    q, k = ins[0], ins[1]
    *batch, L, E = q.shape
    S = k.shape[-2] * int(node.kwargs.get("ranks", 1))
    b, ev = _numel(batch), outs[0].shape[-1]
    return 2 * b * L * S * E + 2 * b * L * S * ev + 5 * b * L * S


def _conv_flops(node, ins, outs):
    w = ins[1]
    per_out = 2 * _numel(w.shape[1:])  # in_channels/groups * kernel
    return _numel(outs[0].shape) * per_out


def _norm_flops(node, ins, outs):
    return 8 * _numel(outs[0].shape)


def _softmax_flops(node, ins, outs):
    return 5 * _numel(outs[0].shape)


def _reduction_flops(node, ins, outs):
    return _numel(ins[0].shape) if ins else 0


def _cross_entropy_flops(node, ins, outs):
    return 6 * _numel(ins[0].shape) if ins else 0


def _zero_flops(node, ins, outs):
    return 0


def _elementwise_flops(node, ins, outs):
    return sum(_numel(o.shape) for o in outs)


_VIEW_OPS = fam.NO_ARITHMETIC   # views, copies, factories, gathers and joins: no FLOPs

FLOP_RULES = {
    "mm": _matmul_flops, "bmm": _matmul_flops, "matmul": _matmul_flops,
    "linear": _linear_flops, "addmm": _addmm_flops, "baddbmm": _baddbmm_flops,
    **{name: _sdpa_flops for name in fam.ATTENTION},
    **{name: _conv_flops for name in fam.CONV_CALLS},
    "ring_attention": _ring_flops, "causal_conv1d": _conv_flops,
    "layer_norm": _norm_flops, "native_layer_norm": _norm_flops, "rms_norm": _norm_flops,
    "group_norm": _norm_flops, "batch_norm": _norm_flops,
    **{name: _softmax_flops for name in fam.SOFTMAXES},
    "sum": _reduction_flops, "mean": _reduction_flops, "amax": _reduction_flops,
    "max": _reduction_flops, "var": _reduction_flops, "var_mean": _reduction_flops,
    **{name: _cross_entropy_flops for name in fam.CROSS_ENTROPIES},
    "nll_loss": _reduction_flops, "nll_loss_nd": _reduction_flops,
    **{name: _zero_flops for name in _VIEW_OPS},
}

# What autograd keeps for each op's backward, as JAX keeps per-primitive rules: a tuple of
# argument positions, "out" for the op's output, or "mask" for a dropout mask (1 byte per
# element). Parameters and buffers are not activations and never count. Ops absent here
# keep their floating-point tensor arguments (a safe over-estimate for pointwise math).
# (besides the no-arithmetic ops, whose backward needs no values either)
_SAVES_NOTHING = fam.METADATA_CHECKS | {
    "add", "sub", "neg", "sum", "mean", "amax", "max", "argmax", "eq", "ne", "lt", "le", "gt", "ge",
    "bitwise_not", "logical_not", "bitwise_and", "logical_and", "bitwise_or", "cumsum", "diff", "pipe_split"}
SAVE_RULES: dict[str, tuple] = {
    **{name: () for name in _VIEW_OPS | _SAVES_NOTHING if name not in ("embedding", "dropout")},
    "linear": (0,), "conv1d": (0,), "conv2d": (0,), "convolution": (0,),
    "mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2),
    "layer_norm": (0,), "native_layer_norm": (0,), "rms_norm": (0,), "group_norm": (0,),
    "batch_norm": (0,),
    **{name: ("out",) for name in fam.SOFTMAXES},
    "scaled_dot_product_attention": (0, 1, 2, "out"),
    "relu": ("out",), "sigmoid": ("out",), "tanh": ("out",), "exp": ("out",), "rsqrt": ("out",),
    "sqrt": ("out",), "gelu": (0,), "silu": (0,), "pow": (0,), "masked_fill": (1,),
    "embedding": (1,), "dropout": ("mask",), "native_dropout": ("mask",),
    "cross_entropy_loss": (0,), "nll_loss": (0,), "nll_loss_nd": (0,), "mse_loss": (0, 1),
    "index": (1,), "gather": (2,), "index_select": (2,), "where": (0,),
}


def _saved_values(node: fx.Node, name: str) -> list[tuple[str, int]]:
    """(value name, bytes) of the activations autograd keeps for this node's backward."""
    rule = SAVE_RULES.get(name)
    if rule is None:
        rule = tuple(i for i, a in enumerate(node.args) if isinstance(a, fx.Node)
                     and (meta_of(a) is not None and meta_of(a).dtype.is_floating_point))
    out: list[tuple[str, int]] = []
    for r in rule:
        if r == "out":
            m = meta_of(node)
            if m is not None:
                out.append((node.name, m.nbytes))
        elif r == "mask":
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            m = meta_of(node)
            if m is not None and p and p > 0:
                out.append((node.name + ".mask", m.numel))
        elif r < len(node.args) and isinstance(node.args[r], fx.Node):
            a = node.args[r]
            m = meta_of(a)
            if m is not None and not (a.op == "placeholder" and tf(a).get("kind") in ("param", "buffer")
                                      or name in fam.SCALINGS and not m.dtype.is_floating_point):
                out.append((a.name, m.nbytes))
    if name in fam.SCALINGS and sum(isinstance(a, fx.Node) for a in node.args[:2]) < 2:
        return []  # times a constant: backward needs only the constant
    return list(dict(out).items())  # a value passed twice (x * x) is kept once


def node_cost(node: fx.Node) -> NodeCost:
    if node.op != "call_function":
        return NodeCost()
    ins = _tensor_metas(node.args) + _tensor_metas(list(node.kwargs.values()))
    outs = _out_metas(node)
    name = op_name(node)
    rule = FLOP_RULES.get(name, _elementwise_flops)
    try:
        flops = int(rule(node, ins, outs)) if outs or rule is not _elementwise_flops else 0
    except (IndexError, TypeError):
        flops = _elementwise_flops(node, ins, outs)
    # a view moves no bytes, and neither does a dtype assert (it only checks metadata)
    is_view = name in fam.METADATA_CHECKS or name in _VIEW_OPS and name not in fam.MOVES_BYTES
    read = 0 if is_view else sum(m.nbytes for m in ins)
    written = 0 if is_view else sum(m.nbytes for m in outs)
    params = sum(meta_of(a).nbytes for a in node.all_input_nodes
                 if a.op == "placeholder" and tf(a).get("kind") == "param" and meta_of(a))
    saved = tuple(_saved_values(node, name))
    weight_grad = flops if name in _WEIGHT_GEMMS and _reads_parameter(node) else 0
    return NodeCost(flops=flops, bytes_read=read, bytes_written=written, param_bytes=params,
                    saved_bytes=sum(b for _, b in saved), saved=saved, weight_grad_flops=weight_grad)


_WEIGHT_GEMMS = fam.GEMMS | fam.CONV_CALLS


def _reads_parameter(node: fx.Node) -> bool:
    """Does an operand come from a parameter, directly or through views (a transposed weight)?"""
    for a in node.all_input_nodes:
        while a.op == "call_function" and op_name(a) in _VIEW_OPS and a.all_input_nodes:
            a = a.all_input_nodes[0]
        if a.op == "placeholder" and tf(a).get("kind") == "param":
            return True
    return False


@stage_pass(needs=Traced, guarantees=("costs",))
def annotate_costs(stage: Traced) -> Traced:
    """Needs: shapes on every node. Guarantees: tf['cost'] (a NodeCost) on every compute
    node (of a copy of the graph)."""
    gm = copy_graph_module(stage.gm)
    for node in compute_nodes(gm.graph):
        tf(node)["cost"] = node_cost(node)
    return stage.evolve(gm=gm)


@dataclass
class ChunkCost:
    ops: int = 0
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    param_bytes: int = 0
    activation_bytes: int = 0
    boundary_in_bytes: int = 0
    boundary_out_bytes: int = 0
    params: int = 0               # parameter elements
    weight_grad_flops: int = 0    # backward FLOPs of W (zero bubble): see NodeCost

    @property
    def backward_flops(self) -> tuple[int, int]:
        """(B, W): the backward's 2x forward FLOPs split into input and weight gradients."""
        return 2 * self.flops - self.weight_grad_flops, self.weight_grad_flops


def chunk_costs(prog) -> list[ChunkCost]:
    """Per chunk, per tp rank: what split_pipeline measured when it cut the graph."""
    return [c.cost for c in prog.chunks]


def measure_chunk(state, nodes: dict, param_nodes: dict, chunk, is_last: bool) -> ChunkCost:
    """Sum the node costs of one chunk (names into the cut graph's `nodes`), per tp rank;
    parameters counted once per chunk holding them, at their placeholders' local shapes."""
    c = ChunkCost()
    kept: set[str] = set()
    for name in chunk.nodes + chunk.recomputed:
        cost: NodeCost = tf(nodes[name]).get("cost") or node_cost(nodes[name])
        c.ops += 1
        c.flops += cost.flops
        c.weight_grad_flops += cost.weight_grad_flops
        c.bytes_read += cost.bytes_read
        c.bytes_written += cost.bytes_written
        for value, nbytes in cost.saved:  # a value several ops keep is held once
            if value not in kept:
                kept.add(value)
                c.activation_bytes += nbytes
    for fqn in chunk.params:  # this tp rank's share: the placeholder's (local) shape
        m = meta_of(param_nodes[fqn]) if fqn in param_nodes else TensorMeta.of(state[fqn])
        c.params += m.numel
        c.param_bytes += m.nbytes
    c.boundary_in_bytes = sum(b.nbytes for b in chunk.inputs)
    if not is_last:  # the last chunk's outputs (the loss) go nowhere
        c.boundary_out_bytes = sum(b.nbytes for b in chunk.outputs)
    return c


def imbalance(values: list[float]) -> float:
    """max / mean; 1.0 is perfect balance."""
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0
