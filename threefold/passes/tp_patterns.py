"""Graph patterns the tensor-parallel pass looks for around a matmul with a parameter.

Which ops are matmuls against a parameter (linear, addmm, mm/matmul of W or of W.T,
grouped expert matmuls), whether the output is a fused projection split or sliced into
pieces (`blocks`), how many heads it is viewed as, whether it feeds the cross-entropy.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.annotations import Collective
from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.ops.families import (CROSS_ENTROPIES, GROUPED_MATMULS, KEEPS_LAST_DIM, MOVES_DIMS_APART, RESHAPES,
                                    SPLITS, TRANSPOSES)


def _is_param(a) -> bool:
    return isinstance(a, fx.Node) and a.op == "placeholder" and tf(a).get("kind") == "param"


def _param_weight(old: fx.Node, name: str):
    """(x, weight, bias, out_dim) for matmuls with a 2-D parameter weight, else None."""
    a = old.args
    if name == "linear" and _is_param(a[1]) and len(_shape(a[1])) == 2:
        bias = a[2] if len(a) > 2 and _is_param(a[2]) else None
        return a[0], a[1], bias, 0
    if name == "addmm" and _is_param(a[2]) and len(_shape(a[2])) == 2 and not old.kwargs:
        return a[1], a[2], a[0] if _is_param(a[0]) else None, 1
    if name in ("mm", "matmul") and _is_param(a[1]) and len(_shape(a[1])) == 2:
        return a[0], a[1], None, 1
    if name in ("mm", "matmul") and isinstance(a[1], fx.Node) and op_name(a[1]) in TRANSPOSES \
            and _is_param(a[1].args[0]) and len(_shape(a[1].args[0])) == 2 and _is_2d_swap(a[1]):
        return a[0], a[1].args[0], None, 0   # x @ W.T with W [out, in]
    if name in GROUPED_MATMULS and isinstance(a[1], fx.Node):   # MoE experts: x [N, in] @ w[e] [in, out]
        if _is_param(a[1]) and len(_shape(a[1])) == 3:
            return a[0], a[1], None, 2
        if op_name(a[1]) in TRANSPOSES and _is_param(a[1].args[0]) and len(_shape(a[1].args[0])) == 3 \
                and _swaps_last_two(a[1]):
            return a[0], a[1].args[0], None, 1   # the parameter is [E, out, in]
    return None


def _swaps_last_two(node: fx.Node) -> bool:
    name = op_name(node)
    if name == "transpose":
        return sorted(d % 3 for d in node.args[1:3]) == [1, 2]
    return name == "permute" and [d % 3 for d in node.args[1]] == [0, 2, 1]


def _is_2d_swap(node: fx.Node) -> bool:
    name = op_name(node)
    if name in ("t", "numpy_T"):
        return True
    if name == "permute":
        return [d % 2 for d in node.args[1]] == [1, 0]
    return sorted(d % 2 for d in node.args[1:3]) == [0, 1]


def x_old_of(old: fx.Node, name: str) -> fx.Node:
    return old.args[1] if name == "addmm" else old.args[0]


def _replace(args, before, after):
    return tuple(after if a is before else a for a in args)


def _shape(node: fx.Node) -> list[int]:
    return list(node.meta["val"].shape)


def _chain(old: fx.Node, limit: int = 6):
    """Single-user successors of a matmul output that keep its last dim."""
    node = old
    for _ in range(limit):
        if len(node.users) != 1:
            return
        user = next(iter(node.users))
        yield user
        if op_name(user) not in KEEPS_LAST_DIM or not isinstance(user.meta.get("val"), torch.Tensor):
            return
        if user.meta["val"].shape[-1] != old.meta["val"].shape[-1]:
            return
        node = user


def _split_blocks(old: fx.Node, out: int) -> tuple[int, ...]:
    sliced = _slice_blocks(old, out)
    if sliced:
        return sliced
    for user in _chain(old):
        name = op_name(user)
        if name == "unflatten":   # nn.MultiheadAttention: [.., 3C] -> [.., 3, C]
            rank = len(user.args[0].meta["val"].shape)
            sizes = list(user.args[2])
            if user.args[1] % rank == rank - 1 and len(sizes) == 2 and sizes[0] > 1 and _selects_pieces(user):
                return (out // sizes[0],) * sizes[0]
            return ()
        if name in SPLITS:
            rank = len(user.args[0].meta["val"].shape)
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % rank != rank - 1:
                return ()
            if name == "split":
                size = user.args[1]
                sizes = [size] * (out // size) + ([out % size] if out % size else [])
            elif name == "chunk":
                k = user.args[1]
                sizes = [out // k] * k
            else:
                sizes = list(user.args[1])
            return tuple(sizes) if len(sizes) > 1 else ()
    return ()


def _selects_pieces(node: fx.Node, limit: int = 6) -> bool:
    """Whether the dim an unflatten makes is later picked apart with select/unbind (q, k, v
    as pieces), rather than kept as a heads dim."""
    for _ in range(limit):
        if any(op_name(u) in ("select", "unbind") for u in node.users):
            return True
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
        if op_name(node) not in MOVES_DIMS_APART:
            return False
    return False


def _slice_blocks(old: fx.Node, out: int) -> tuple[int, ...]:
    """A fused projection read through slices of its last dim (q = qkv[..., :C], ...):
    the pieces between the slices' bounds, so each is split separately."""
    node = old
    for user in _chain(old):
        v = user.meta.get("val")
        if op_name(user) not in KEEPS_LAST_DIM or not isinstance(v, torch.Tensor) or v.shape[-1] != out:
            break
        node = user
    users = list(node.users)
    if len(users) < 2 or not all(op_name(u) == "slice" for u in users):
        return ()
    rank = len(node.meta["val"].shape)
    cuts = {0, out}
    for u in users:
        dim = (u.args[1] if len(u.args) > 1 else 0) % rank
        step = u.args[4] if len(u.args) > 4 else 1
        if dim != rank - 1 or step != 1:
            return ()
        start = u.args[2] if len(u.args) > 2 and u.args[2] is not None else 0
        end = u.args[3] if len(u.args) > 3 and u.args[3] is not None else out
        cuts |= {min(max(start % out if start < 0 else start, 0), out), min(end if end >= 0 else end % out, out)}
    cuts = sorted(cuts)
    return tuple(b - a for a, b in zip(cuts, cuts[1:])) if len(cuts) > 2 else ()


def _head_count(old: fx.Node) -> int | None:
    """Heads, if the matmul output is viewed as [..., heads, head_dim] right away."""
    last = old.meta["val"].shape[-1]
    for user in _chain(old):
        if op_name(user) in RESHAPES:
            shape = list(user.meta["val"].shape)
            if len(shape) >= 2 and shape[-2] * shape[-1] == last and shape[-1] != last:
                return shape[-2]
    return None


def _feeds_cross_entropy(old: fx.Node) -> bool:
    for user in _chain(old):
        if op_name(user) in CROSS_ENTROPIES:
            return True
    return False


def _needs_grad(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _coll(kind: str, phase: str, v, back: str | None = None, regathers: bool = False) -> Collective:
    numel = int(v.numel()) if isinstance(v, torch.Tensor) else 0
    return Collective(kind, phase, numel, backward=back, regathers=regathers)
