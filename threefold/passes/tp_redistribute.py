"""The tensor-parallel pass's one redistribution step, and its fallback.

A rule (tp_rules*.py) names how each input must arrive (`Cut`, `ENTER`, `Whole`,
`Gathered`); `redistribute` brings a value there with the rewriter's collectives
(tp_collectives.py), once per value.

Where no sharded rule applies (the rule says NoRule, or a redistribution cannot be done),
the rewriter undoes whatever it had emitted for the op, brings every input of the op back to a replicated value (all-gather a
shard with a differentiable gather whose backward slices, undo vocabulary padding, reduce a
partial sum) and runs the op on the whole values. The op is never computed on the wrong
shard. Each fallback is recorded as the sharding walker's one `Fallback` record (passes/shard.py:
op, module FQN, bytes moved per step; its note is `fallback_note`; tp's `fallback` hook makes
it), listed by `threefold inspect`, and is a PlanError under `Plan(strict=True)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.errors import PlanError
from threefold.passes.tp_placement import Partial, Replicate, Shard

GATHERS = "gathers its inputs"   # what a tp fallback does (its Fallback record's `how`)


class NoRule(PlanError):
    """No sharded rule applies to this op with these input placements."""


# -- how a rule asks for an input (the values of Decision.needs) -----------------------------

@dataclass(frozen=True)
class Cut:
    """A replicated value cut on `dim` the way `like` is laid out (blocks, sequence)."""
    dim: int
    like: Shard


@dataclass(frozen=True)
class Enter:
    """A replicated value broadcast over a shard: an activation's gradient from each rank is
    a summand, so it enters through f (all-reduce backward), as Megatron's f does."""


ENTER = Enter()


@dataclass(frozen=True)
class Whole:
    """Replicated. exact: as the single process has it (a gathered sequence read from its
    source, vocabulary or sequence padding cut off); else any replicated form
    (a sequence shard all-gathered for a matmul)."""
    exact: bool = False


@dataclass(frozen=True)
class Gathered:
    """A shard all-gathered plainly along `dim` (backward slices)."""
    dim: int


def redistribute(rw, x: fx.Node, need, old: fx.Node | None = None) -> fx.Node:
    """x (a new-graph value) as `need` asks (None: as it is). A need may bring the value
    itself (`need.bring`: a weight matmul's operands, tp_weights.py, tp_pieces.py)."""
    if need is None:
        return x
    if hasattr(need, "bring"):
        return need.bring(rw, x, old)
    if isinstance(need, Cut):
        return rw.scatter_like(x, need.dim, need.like)
    if isinstance(need, Enter):
        return _entering_shards(rw, x)
    if isinstance(need, Whole):
        if need.exact:
            return replicated(rw, x, old.meta.get("val") if old is not None else None)[0]
        return rw.to_replicated(x)
    if isinstance(need, Gathered):
        return rw.gather(x, need.dim)
    raise TypeError(f"unknown redistribution {need!r}")


def _entering_shards(rw, a: fx.Node) -> fx.Node:
    """Parameters (and values made from them alone) are summed by tp_grad_sync instead;
    values without a gradient need no f."""
    p = rw.place[a]
    v = rw.val[a]
    if not isinstance(p, Replicate) or p.partial_grad or not (isinstance(v, torch.Tensor) and v.dtype.is_floating_point):
        return a
    src = rw.old_of.get(a)
    if src is None or rw._param_sources(src) is not None or not rw.has_grad(src):
        return a
    return rw.f(a)


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


def fallback(rw, old: fx.Node, reason: str) -> tuple[fx.Node, int]:
    """Run `old` on replicated inputs; the node and the bytes per rank a microbatch moves for
    it (tp's `fallback` hook makes them the walker's Fallback record)."""
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
    rw.fallback_blocked.append(sorted(blamed))
    for fqn in blamed:
        rw.blamed.setdefault(fqn, f"{op_name(old)} in {tf(old).get('module', '') or '<top>'}")
    return node, moved


def _nbytes(v) -> int:
    return int(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0


def _meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v
