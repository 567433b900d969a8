"""`FusedRegion`: one fused kernel's worth of graph, as a small self-contained op list.

The fusion pass (passes/fusion.py) cuts regions out of a rank's graph and replaces each by
one call_function node whose target is a FusedRegion. The region keeps no reference to the
graph: its IR is a list of `Op`s over region inputs (`Ref('x', k)`) and earlier op results
(`Ref('v', j)`), with constants inline. Calling the region runs those ATen ops eagerly, so
the graph stays runnable as plain fx; codegen/triton.py turns the same list into Triton.

Which ops may be fused lives here (ELEMENTWISE, ROW_OPS); the Triton rule for each lives in
codegen/triton_rules.py, and a test checks that the two tables agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from threefold.ops.families import SCALINGS
from threefold.runtime import kernels as rt

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ATen op -> short name (used in kernel names and to pick the codegen rule).
ELEMENTWISE = {
    "aten.add.Tensor": "add", "aten.add.Scalar": "add",
    "aten.sub.Tensor": "sub", "aten.sub.Scalar": "sub", "aten.rsub.Scalar": "rsub",
    "aten.mul.Tensor": "mul", "aten.mul.Scalar": "mul",
    "aten.div.Tensor": "div", "aten.div.Scalar": "div",
    "aten.neg.default": "neg", "aten.exp.default": "exp", "aten.log.default": "log",
    "aten.tanh.default": "tanh", "aten.sigmoid.default": "sigmoid", "aten.relu.default": "relu",
    "aten.gelu.default": "gelu", "aten.silu.default": "silu", "aten.erf.default": "erf",
    "aten.sqrt.default": "sqrt", "aten.rsqrt.default": "rsqrt", "aten.reciprocal.default": "reciprocal",
    "aten.sin.default": "sin", "aten.cos.default": "cos", "aten.pow.Tensor_Scalar": "pow",
    "aten.dropout.default": "dropout", "aten.masked_fill.Scalar": "masked_fill",
    "aten.where.self": "where", "aten.bitwise_not.default": "not", "aten.logical_not.default": "not",
    "aten._to_copy.default": "cast", "aten.to.dtype": "cast", "aten.clone.default": "clone",
}
# Ops that need whole rows (the last dim) in one tile, plus the synthetic ops the pass makes.
ROW_OPS = {
    "aten.softmax.int": "softmax", "aten._softmax.default": "softmax",
    "aten.layer_norm.default": "layer_norm", "aten.rms_norm.default": "rms_norm",
    "aten.mean.dim": "mean",
    "rotate_half": "rotate_half",      # cat(-x[..., h:], x[..., :h]) (rotary embeddings)
    "causal_mask": "causal",           # tril/triu(ones) of the last two dims, made in-kernel
}
POW_EXPONENTS = (1, 2, 3, 0.5, -0.5, -1)


@dataclass(frozen=True)
class Ref:
    kind: str    # 'x': region input, 'v': result of an earlier op
    index: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.index}"


@dataclass(frozen=True)
class Op:
    target: str                  # 'aten.add.Tensor', or a synthetic op ('rotate_half', 'causal_mask')
    args: tuple                  # Refs and constants, in the ATen schema's order
    kwargs: tuple = ()           # ((name, value), ...)
    dtype: torch.dtype = torch.float32   # the result's dtype
    node: str = field(default="", compare=False)   # source node (comments only)

    @property
    def short(self) -> str:
        return ELEMENTWISE.get(self.target) or ROW_OPS[self.target]

    def kw(self, name: str, default=None):
        return dict(self.kwargs).get(name, default)


@dataclass(frozen=True)
class RegionInput:
    dtype: torch.dtype
    pattern: str                 # full | col | row | scalar | general (see runtime/kernels.py)
    shape: tuple = field(default=(), compare=False)   # trace-time shape (comments only)


@dataclass(eq=False)
class FusedRegion:
    """A fused kernel node's target. Calling it runs the region's ATen ops eagerly."""
    kernel_name: str
    kind: str                    # bias_gelu | bias_dropout_add | dropout_add | swiglu | elementwise
                                 # | softmax | layer_norm | rms_norm | rotary
    source_nodes: list[str]
    inputs: list[RegionInput]
    ops: list[Op]
    outputs: list[int]           # indices into ops
    shape: tuple[int, ...]       # trace-time output shape
    row: bool                    # needs whole rows per tile
    description: str = ""        # e.g. "bias + GeLU (erf)"

    def __post_init__(self):
        self.__name__ = f"fused_{self.kernel_name}"   # fx names the graph's global after this

    @property
    def signature(self) -> tuple:
        """Equal signatures <=> the same generated kernel (sizes are run-time arguments)."""
        return (self.kind, self.row, len(self.shape),
                tuple((i.dtype, i.pattern) for i in self.inputs),
                tuple((o.target, o.args, o.kwargs, o.dtype) for o in self.ops),
                tuple(self.outputs))

    @property
    def out_dtypes(self) -> tuple:
        return tuple(self.ops[j].dtype for j in self.outputs)

    def __call__(self, *xs):
        vals = run_ops(self.ops, xs)
        outs = tuple(vals[j] for j in self.outputs)
        return outs[0] if len(outs) == 1 else outs

    def __repr__(self) -> str:
        return f"FusedRegion({self.kernel_name}: {', '.join(self.source_nodes)})"


def resolve(target: str):
    """'aten.add.Tensor' -> torch.ops.aten.add.Tensor."""
    ns, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def run_ops(ops: list[Op], xs) -> list:
    """Run an op list eagerly; returns every op's result."""
    vals: list = []

    def get(a):
        if isinstance(a, Ref):
            return xs[a.index] if a.kind == "x" else vals[a.index]
        if isinstance(a, (list, tuple)):
            return type(a)(get(b) for b in a)
        return a

    for op in ops:
        args = [get(a) for a in op.args]
        if op.target == "rotate_half":
            vals.append(rt.rotate_half(*args))
        elif op.target == "causal_mask":
            vals.append(rt.causal_mask(*args))
        else:
            vals.append(resolve(op.target)(*args, **{k: get(v) for k, v in op.kwargs}))
    return vals


def classify(ops: list[Op], inputs: list[RegionInput]) -> tuple[str, str, str]:
    """(kind, readable kernel name, description) of a region from its ops."""
    shorts = [o.short for o in ops]
    has = set(shorts)

    def scaled():
        return any(o.short in SCALINGS and any(not isinstance(a, Ref) for a in o.args) for o in ops)

    if "softmax" in has:
        parts = ["scale"] if scaled() else []
        if "causal" in has:
            parts.append("causal_mask")
        elif has & {"masked_fill", "where"} or any(o.short == "add" and _takes_input(o) for o in ops):
            parts.append("mask")
        name = "_".join(parts + ["softmax"])
        return "softmax", name, " + ".join(parts + ["softmax"]).replace("_", " ")
    if "layer_norm" in has:
        return "layer_norm", "layer_norm", "LayerNorm"
    if "rms_norm" in has or {"pow", "mean", "rsqrt"} <= has:
        return "rms_norm", "rms_norm", "RMSNorm"
    if "rotate_half" in has:
        return "rotary", "rotary", "rotary embedding (x * cos + rotate_half(x) * sin)"
    if shorts == ["add", "gelu"] and _has_col(ops[0], inputs):
        form = "tanh" if ops[1].kw("approximate", "none") == "tanh" else "erf"
        return "bias_gelu", f"bias_gelu_{form}", f"bias + GeLU ({form})"
    if shorts == ["add", "dropout", "add"] and _has_col(ops[0], inputs):
        return "bias_dropout_add", "bias_dropout_add", "bias + dropout + residual add"
    if shorts == ["dropout", "add"]:
        return "dropout_add", "dropout_add", "dropout + residual add"
    if shorts == ["silu", "mul"] and Ref("v", 0) in ops[1].args:
        return "swiglu", "swiglu", "SwiGLU: silu(a) * b"
    names = [s for s in shorts if s != "causal"]
    tail = names if len(names) <= 6 else names[:6] + [f"{len(names)}ops"]
    return "elementwise", "ew_" + "_".join(tail), "elementwise: " + ", ".join(names)


def _takes_input(op: Op) -> bool:
    return any(isinstance(a, Ref) and a.kind == "x" for a in op.args)


def _has_col(op: Op, inputs: list[RegionInput]) -> bool:
    return any(isinstance(a, Ref) and a.kind == "x" and inputs[a.index].pattern == "col" for a in op.args)
