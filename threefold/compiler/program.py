"""Helpers over the compiler's fx graphs; the stages themselves are in compiler/stages.py.

Placeholders are of four kinds, recorded in `node.meta["tf"]["kind"]`:
  param    a parameter, `fqn` its canonical FQN (the first name of a tied group)
  buffer   a buffer or a lifted constant tensor, `fqn` its name
  input    a user input (model inputs first, then the target), `input_index` its position
  boundary a value received from the previous chunk (chunk graphs only)
Every other node carries its output's shape and dtype in `node.meta["val"]`, and passes
add typed annotations under `node.meta["tf"]` (the keys: compiler/annotations.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx



@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

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


def format_program(prog) -> str:
    """A readable listing of a stage: one line per node with its shape, dtype and annotations."""
    from threefold.compiler.stage_io import format_stage
    return format_stage(prog)


def format_chunk(chunk) -> str:
    """One chunk's own graph, in format_program's style."""
    lines = [f"chunk {chunk.index}: {len(chunk.nodes)} ops, {len(chunk.recomputed)} recomputed, "
             f"in={chunk.input_names} out={chunk.output_names}"]
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


# The stage every pass reads and returns (compiler/stages.py); kept under its old name for
# type hints elsewhere. Imported last: stages.py uses the helpers above.
from threefold.compiler.stages import Chunk, Stage as Program  # noqa: E402,F401
