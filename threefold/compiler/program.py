"""`Program`: the compiler's IR. An fx graph of ATen ops plus the plan and annotations.

Placeholders are of four kinds, recorded in `node.meta["tf"]["kind"]`:
  param   a parameter, `fqn` its canonical FQN (the first name of a tied group)
  buffer  a buffer or a lifted constant tensor, `fqn` its name
  input   a user input (model inputs first, then the target), `input_index` its position
Every other node carries its output's shape and dtype in `node.meta["val"]`, and passes
add their own annotations under `node.meta["tf"]` (chunk index, cost, sharding, ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from threefold.plan import Plan


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(int(s) for s in t.shape), t.dtype)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", "")}


def dtype_bytes(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 1
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass
class Chunk:
    """One pipeline chunk: a contiguous range of the graph's compute nodes."""
    index: int
    nodes: list[str]                 # compute node names, in graph order
    inputs: list[str]                # boundary values received from the previous chunk
    outputs: list[str]               # boundary values sent to the next chunk (last: the loss)
    user_inputs: list[int]           # indices of user inputs read directly from the batch
    params: list[str]                # canonical FQNs used
    buffers: list[str]               # buffer / constant names used
    recomputed: list[str] = field(default_factory=list)  # cheap shared nodes copied in
    gm: fx.GraphModule | None = None # the chunk as its own graph (after extract_chunks)


@dataclass
class Program:
    name: str                        # model class name, for messages and headers
    gm: fx.GraphModule
    plan: Plan
    state: dict[str, torch.Tensor]   # canonical FQN / buffer name -> tensor (real or meta)
    ties: dict[str, list[str]]       # canonical FQN -> every FQN of that tied parameter
    input_names: list[str]           # user inputs in call order (model inputs, then target)
    num_model_inputs: int            # how many of input_names are model inputs
    has_loss: bool                   # the graph's single output is the loss
    output_meta: list[TensorMeta] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # shown by inspect
    pass_log: list[tuple[str, float]] = field(default_factory=list)
    kernels: dict = field(default_factory=dict)         # fused-kernel name -> region (fusion pass)
    # FQN -> fn(full tensor, tp_rank) -> this rank's shard (tensor parallel pass); absent = whole
    shard_fns: dict = field(default_factory=dict)
    # parameters applied to sharded activations (sequence-parallel norms): grads summed over tp
    tp_grad_sync: list = field(default_factory=list)
    # how the loss combines microbatches and dp ranks (passes/loss_form.py; manifest "loss")
    loss_form: dict | None = None
    # graph of the loss denominator over user inputs (and buffers), or None (passes/loss_form.py)
    loss_denominator: fx.GraphModule | None = None
    # per user input (model inputs, then target): its batch dimension, None = not split
    batch_dims: list | None = None
    micro_rows: int | None = None    # rows (batch-dim length) of the traced microbatch
    output_batch_dims: list | None = None  # per model output: its batch dim (forward-only)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def is_meta(self) -> bool:
        return any(t.is_meta for t in self.state.values())

    def replace(self, **changes) -> "Program":
        return dataclasses.replace(self, **changes)

    def node(self, name: str) -> fx.Node:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.graph.nodes}

    def param_names(self) -> list[str]:
        return [tf(n)["fqn"] for n in self.graph.nodes if n.op == "placeholder" and tf(n)["kind"] == "param"]

    def __str__(self) -> str:
        return format_program(self)


def tf(node: fx.Node) -> dict:
    """The node's threefold annotations (created on first use)."""
    return node.meta.setdefault("tf", {})


def meta_of(node) -> TensorMeta | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return TensorMeta.of(val)
    return None


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


def format_program(prog: Program) -> str:
    """A readable listing: one line per node with its shape, dtype and annotations."""
    lines = [f"program {prog.name}  plan: {prog.plan}"]
    if prog.ties:
        lines.append("tied: " + "; ".join(f"{k} = {', '.join(v)}" for k, v in prog.ties.items()))
    lines += [format_node(node) for node in prog.graph.nodes]
    for chunk in prog.chunks:
        lines.append(f"chunk {chunk.index}: {len(chunk.nodes)} ops, in={chunk.inputs} out={chunk.outputs}")
    return "\n".join(lines)


def format_chunk(chunk: Chunk) -> str:
    """One chunk's own graph (after extract_chunks), in format_program's style."""
    lines = [f"chunk {chunk.index}: {len(chunk.nodes)} ops, {len(chunk.recomputed)} recomputed, "
             f"in={chunk.inputs} out={chunk.outputs}"]
    if chunk.gm is not None:
        lines += [format_node(node) for node in chunk.gm.graph.nodes]
    return "\n".join(lines)


def format_node(node: fx.Node) -> str:
    ann = {k: v for k, v in tf(node).items()
           if k not in ("fqn", "kind", "cost", "input_index") and v not in ("", None)}
    meta = meta_of(node)
    shape = f"{list(meta.shape)}:{str(meta.dtype).replace('torch.', '')}" if meta else ""
    if node.op == "placeholder":
        what = f"{tf(node).get('kind', '?')} {tf(node).get('fqn', node.name)}"
        return f"  %{node.name} = {what}  {shape}"
    if node.op == "output":
        return f"  return {_fmt_arg(node.args[0])}"
    args = ", ".join(_fmt_arg(a) for a in node.args)
    note = "  " + " ".join(f"{k}={v}" for k, v in ann.items()) if ann else ""
    return f"  %{node.name} = {_target_name(node.target)}({args})  {shape}{note}"


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _fmt_arg(a) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    return repr(a)
