"""Values the model makes in forward from a shape along the sequence, under cp (plan `cp=N`).

A model that is not given an attention mask often makes one of ones in forward,
`torch.ones(b, T)`, and derives positions from it (OPT: `cumsum(mask, 1) * mask - 1`), or
multiplies the hidden states by it (DeBERTa). Traced on this rank's share of the sequence,
T is the local length n, so the factory is `ones(b, n)`: uniform along the sequence, it
holds the same values as this rank's share of `ones(b, S)`, but nothing tells the sequence
rules (passes/cp_rules/) that it runs along the sequence, so what is computed from it (a
cumulative sum: positions) looks like a table that varies per position and is refused.

`split_factories` is called where the rules refuse such a value: each uniform factory it is
made of (ones / zeros / full / empty and their `new_*` forms, or an expand of a value of
size 1 there) with exactly one dim of the local length becomes the factory at the whole
length S, cut to this rank's blocks (cp_gather.shard_seq). Its values are unchanged; its
placement now says it runs along the sequence, so what follows is checked like any other
sequence value: position-wise ops keep the split, a scan over it (the cumsum) takes the
exact all-gather fallback (passes/cp_fallback.py), and anything else is refused by its rule.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.ops.families import UNIFORM_FACTORIES, args_of, op_name
from threefold.runtime import cp_gather
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


def split_factories(value: fx.Node, state: dict, stage) -> list:
    """Rewrite each uniform factory of the local length that `value` is made of (through
    values not along the sequence) to its whole-length form cut to this rank's blocks.
    Returns the shard_seq nodes inserted ([] where there is none)."""
    n, cp = stage.seq_len, stage.plan.cp
    return [_whole_then_cut(x, d, n, cp) for x, d in local_factories(value, state, n, stage)]


def local_factories(value: fx.Node, state: dict, n: int, stage=None) -> list:
    """(node, dim) of each uniform factory of the local length n that `value` is made of."""
    found, seen, stack = [], set(), [value]
    while stack:
        x = stack.pop()
        if not isinstance(x, fx.Node) or x in seen or state.get(x) is not None:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
        d = _sequence_dim(x, n, stage)
        if d is not None:
            found.append((x, d))
    return found


def _sequence_dim(x: fx.Node, n: int, stage=None):
    """The dim along which x is a uniform factory of the local length n, else None. One dim
    of size n only; where another has that size too (a batch of n rows), the one that has the
    whole length in the model traced at it (stage.retrace) — a coincidence is not guessed."""
    if x.op != "call_function" or not isinstance(x.target, torch._ops.OpOverload):
        return None
    name, val = op_name(x), x.meta.get("val")
    if not isinstance(val, torch.Tensor) or name not in UNIFORM_FACTORIES | {"expand"}:
        return None
    dims = [d for d in range(val.dim()) if val.shape[d] == n]
    if len(dims) > 1:
        dims = _grown_dims(x, dims, n, stage)
    if len(dims) != 1:
        return None
    d = dims[0]
    if name == "expand":   # a broadcast of a value of size 1 (or no dim) there is uniform along it
        src = args_of(x)["self"].meta.get("val")
        i = d - (val.dim() - src.dim())
        if not isinstance(src, torch.Tensor) or (i >= 0 and src.shape[i] != 1):
            return None
    size = args_of(x).get("size")
    if not isinstance(size, (list, tuple)) or len(size) != val.dim() or size[d] != n:
        return None
    return d


def _grown_dims(x: fx.Node, dims: list, n: int, stage) -> list:
    """Of x's dims of size n, those its twin in the model traced at the whole length has grown
    to it ([] where there is no retrace or no twin of the same op)."""
    if getattr(stage, "retrace", None) is None:
        return []
    whole = n * stage.plan.cp
    try:
        graph = stage.retrace(whole)
    except Exception:   # the model does not trace at the whole length: no answer, no guess
        return []
    twin = next((t for t in graph.nodes if t.name == x.name and t.target == x.target), None)
    val = twin.meta.get("val") if twin is not None else None
    if not isinstance(val, torch.Tensor) or val.dim() != x.meta["val"].dim():
        return []
    return [d for d in dims if val.shape[d] == whole]


def _whole_then_cut(x: fx.Node, d: int, n: int, cp: int) -> fx.Node:
    """x(size with n at d) -> shard_seq(x(size with n*cp at d), d): the same values, now
    known to be this rank's blocks of the whole."""
    graph = x.graph
    names = [a.name for a in x.target._schema.arguments]
    i = names.index("size")
    size = list(args_of(x)["size"])
    size[d] = n * cp
    args, kwargs = list(x.args), dict(x.kwargs)
    if i < len(args):
        args[i] = size
    else:
        kwargs["size"] = size
    with graph.inserting_before(x):
        whole = graph.call_function(x.target, tuple(args), kwargs)
        cut = graph.call_function(cp_gather.shard_seq, (whole, d, CP), {"ranks": cp})
    whole.meta = {"val": x.target(*fx.node.map_arg(tuple(args), lambda a: a.meta["val"]),
                                  **fx.node.map_arg(kwargs, lambda a: a.meta["val"])), "tf": dict(tf(x))}
    cut.meta = {"val": x.meta["val"], "tf": dict(tf(x))}
    x.replace_all_uses_with(cut)
    graph.erase_node(x)
    return cut
