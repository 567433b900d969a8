"""How a generated line looks: its comment (source module, placement, local shape) and its
wrapping (codegen/python.py and backward_split.py both write lines)."""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf

_WIDTH = 100   # generated lines wrap their arguments beyond this


def wrap_call(first: str, args: list[str], comment: str, indent: str, close: str = ")") -> list[str]:
    """`first` + args + `close` on one line when it fits, else the arguments packed on
    continuation lines (indent + 4) under `first`, which keeps the comment."""
    one = f"{first}{', '.join(args)}{close}"
    if len(one) + len(comment) <= _WIDTH + 20 or not args:
        return [one + comment]
    lines, cur = [(first + comment).rstrip()], indent + "    "
    for i, a in enumerate(args):
        piece = a + (", " if i < len(args) - 1 else close)
        if cur.strip() and len(cur) + len(piece.rstrip()) > _WIDTH:
            lines.append(cur.rstrip())
            cur = indent + "    "
        cur += piece
    return lines + [cur.rstrip()]


def annotation(node: fx.Node) -> str:
    """`h.0.attn.c_attn  S(2)  [2, 8, 24]`: the source module, the TP pass's placement and
    the local (this tp rank's) shape, for the comment on a generated line."""
    # no placement: the TP pass did not run (tp=1), so every value is replicated
    parts = [tf(node).get("module") or "<top>", str(tf(node).get("placement") or "R")]
    shape = _shape_text(node.meta.get("val"))
    if shape:
        parts.append(shape)
    return "  ".join(parts)


def _shape_text(val) -> str:
    if isinstance(val, torch.Tensor):
        return str(list(val.shape))
    if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
        shapes = [str(list(v.shape)) for v in val]
        return f"{shapes[0]} x{len(shapes)}" if len(set(shapes)) == 1 else "(" + ", ".join(shapes) + ")"
    return ""
