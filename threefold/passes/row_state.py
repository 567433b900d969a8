"""Row states and the helpers the row rules share (passes/row_rules.py, row_index_rules.py).

A value's row state is one of
  None          it does not depend on the split inputs (parameters, constants, unsplit inputs)
  Rows(d, s)    row i of the batch lives at index i*s.. of dim d (s: the stride of the batch
                factor inside that dim, >1 after a view merged dims after it, e.g. [B*T, C];
                0 while not known: propagate() then takes the dim's outer factor)
  LOST          it depends on the batch but no rule says where the rows are; nothing after
                is checked
  POS           a tensor of row positions (nonzero, argsort): indexing the rows with it
                selects or permutes rows, which keeps them per-row
and a tuple of states for an op with several outputs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class Rows:
    dim: int
    stride: int = 0   # 0: not known yet; propagate() makes it the dim's outer factor


LOST = "lost"
POS = "positions"

def op_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        return "getitem"
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else getattr(node.target, "__name__", "")


def shape_of(a) -> tuple | None:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    if isinstance(v, torch.Tensor):
        try:
            return tuple(int(s) for s in v.shape)
        except Exception:  # a symbolic size: no rule can place rows in it
            return None
    return None


def arg_of(node: fx.Node, i: int, name: str, default=None):
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def dims_of(dim, ndim: int) -> list[int]:
    if dim is None:
        return list(range(ndim))
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if not dims:  # sum(x, []) reduces every dim
        return list(range(ndim))
    return [d % max(ndim, 1) for d in dims]


def rows_of(states: dict, a):
    return states.get(a) if isinstance(a, fx.Node) else None


def explicit_einsum(eq: str, ndims: list[int]) -> str | None:
    """An einsum equation with its `...` written as letters of their own (the operands'
    ellipsis dims right-aligned, as einsum broadcasts them), spaces dropped; None for an
    implicit output (no '->') or ranks that do not fit it (-1: a rank not known)."""
    eq = eq.replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    if len(subs) != len(ndims):
        return None
    if "..." not in eq:
        return eq
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    extra = [n - (len(s) - 3) if "..." in s else 0 for s, n in zip(subs, ndims)]
    width = max(extra)
    if min(extra) < 0 or width > len(spare) or ("..." in out) != any("..." in s for s in subs):
        return None
    letters = "".join(spare[:width])
    subs = [s.replace("...", letters[width - k:]) for s, k in zip(subs, extra)]
    return ",".join(subs) + "->" + out.replace("...", letters)
