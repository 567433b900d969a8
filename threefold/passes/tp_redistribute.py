"""The tensor-parallel pass's fallback: where no sharded rule applies, redistribute.

A rule that cannot follow a layout raises `NoRule`. The rewriter then undoes whatever the
rule had emitted, brings every input of the op back to a replicated value (all-gather a
shard with a differentiable gather whose backward slices, undo vocabulary padding, reduce a
partial sum) and runs the op on the whole values. The op is never computed on the wrong
shard. Each fallback is recorded (op, module FQN, bytes moved per step), listed by
`threefold inspect`, and is a PlanError under `Plan(strict=True)`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.errors import PlanError
from threefold.passes.tp_placement import Partial, Replicate, Shard


class NoRule(PlanError):
    """No sharded rule applies to this op with these input placements."""


def replicated(rw, x: fx.Node, global_val=None) -> tuple[fx.Node, int]:
    """x as a replicated value, with the bytes per rank a microbatch moves to get there."""
    p = rw.place[x]
    if isinstance(p, Replicate):
        if p.partial_grad:      # f's output: its gradient is all-reduced; read f's input instead
            return rw.f_source[x], 0
        if p.gathered:          # all-gathered sequence shards (backward reduce-scatters)
            src = rw.gathered_from.get(x)
            if src is None:
                raise NoRule(f"tp={rw.t}: {rw._where()} reads a sequence-gathered value outside a matmul")
            x, p = src, rw.place[src]
        else:
            return x, 0
    if isinstance(p, Partial):
        return rw.g(x), 2 * _nbytes(rw.val[x]) * (rw.t - 1) // rw.t
    if isinstance(p, list) or not isinstance(p, Shard):
        raise NoRule(f"tp={rw.t}: {rw._where()} reads a value placed {p}")
    size = global_val.shape[p.dim] if isinstance(global_val, torch.Tensor) else rw.seq_len(x, p.dim)
    whole = rw.gather(x, p.dim, p.blocks)
    moved = _nbytes(rw.val[whole]) * (rw.t - 1) // rw.t
    if size is not None and rw.val[whole].shape[p.dim] != size:   # vocabulary or sequence padding
        whole = rw.emit(torch.ops.aten.slice.Tensor, (whole, p.dim, 0, size), place=Replicate())
    return whole, moved


def fallback(rw, old: fx.Node, reason: str) -> fx.Node:
    """Run `old` on replicated inputs; record what that costs."""
    if rw.prog.plan.strict:
        raise PlanError(f"tp={rw.t}: strict plan: {rw._where()} has no sharded rule ({reason}); "
                        "drop strict=true to let threefold gather its inputs, or use tp=1")
    moved = 0
    blamed: set[str] = set()

    def whole(a: fx.Node) -> fx.Node:
        nonlocal moved
        new = rw.env[a]
        if isinstance(rw.place[new], Shard):
            blamed.update(rw.origin.get(new, ()))
        rep, nbytes = replicated(rw, new, a.meta.get("val"))
        moved += nbytes
        return rep
    args = fx.node.map_arg(old.args, whole)
    kwargs = fx.node.map_arg(old.kwargs, whole)
    rw._note_param_uses(old, sharded=False)
    node = rw.copy_node(old, args=args, kwargs=kwargs, val=_meta(old.meta.get("val")))
    rw.fallbacks.append({"op": op_name(old), "node": old.name, "module": tf(old).get("module", "") or "<top>",
                         "reason": reason.split("; use tp=1")[0],
                         "bytes_per_step": moved * rw.prog.plan.microbatches,
                         "blocked": sorted(blamed)})
    for fqn in blamed:
        rw.blamed.setdefault(fqn, f"{op_name(old)} in {tf(old).get('module', '') or '<top>'}")
    return node


def _nbytes(v) -> int:
    return int(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0


def _meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v
