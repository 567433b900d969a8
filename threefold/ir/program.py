"""Helpers over the compiler's fx graphs (and a stage as text); the stages themselves are in
ir/stages.py.

Placeholders are of four kinds, recorded in `node.meta["tf"]["kind"]`:
  param    a parameter, `fqn` its canonical FQN (the first name of a tied group)
  buffer   a buffer or a lifted constant tensor, `fqn` its name
  input    a user input (model inputs first, then the target), `input_index` its position
  boundary a value received from the previous chunk (chunk graphs only)
Every other node carries its output's shape and dtype in `node.meta["val"]`, and passes
add typed annotations under `node.meta["tf"]` (the keys: ir/annotations.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.runtime.eager_loss import call_loss



class Sized:
    """numel and nbytes of a value with `shape` and `dtype` fields (TensorMeta, BoundarySpec)."""
    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class TensorMeta(Sized):
    shape: tuple[int, ...]
    dtype: torch.dtype

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


def is_eager_loss(node) -> bool:
    """The node that calls a loss function eagerly (compiler/eager_loss.py traced the model alone)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is call_loss


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


def upstream(node: fx.Node) -> set[fx.Node]:
    """node and every node it is computed from."""
    seen, stack = set(), [node]
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return seen


def format_stage(stage) -> str:
    """A readable listing: the stage's kind, then one line per node of each graph with its
    shape, dtype and annotations, and each chunk's boundary specs."""
    lines = [f"{type(stage).__name__} {stage.name}  plan: {stage.plan}"]
    if stage.ties:
        lines.append("tied: " + "; ".join(f"{k} = {', '.join(v)}" for k, v in stage.ties.items()))
    gm = getattr(stage, "gm", None)
    if gm is not None:
        lines += [format_node(node) for node in gm.graph.nodes]
    for c in getattr(stage, "chunks", ()):
        lines.append(f"chunk {c.index}: {len(c.nodes)} ops, {len(c.recomputed)} recomputed")
        lines += [f"  in  {b.name} {list(b.shape)}:{str(b.dtype).replace('torch.', '')} {b.placement}"
                  for b in c.inputs]
        lines += [f"  out {b.name} {list(b.shape)}:{str(b.dtype).replace('torch.', '')} {b.placement}"
                  for b in c.outputs]
        lines += ["  " + format_node(node) for node in c.gm.graph.nodes]
        for seg in c.recompute:
            lines.append(f"  recompute {seg['name']}: {len(seg['nodes'])} ops ({seg['why']})")
    return "\n".join(lines)


format_program = format_stage     # a readable listing of a stage (its older name)


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

