"""What a tensor-parallel rule sees and returns (the registry is threefold/ops/rules.py's).

A rule gets a `TpCall`: the source node (read only), its arguments by schema name, tp's
degree, and for each input the placement it has now on the tp axis and its local (per-rank)
value. It returns a `TpDecision` (ops/rules.Decision plus which parameters the call applies
to shards) or refuses (`refuse(why)`, or a returned `NoRule`). The pass
(tensor_parallel.py) applies decisions; rules are in tp_rules.py, tp_rules_views.py and
tp_rules_share.py, registered on `REGISTRY` by op name or by family (ops/families.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.fx as fx

from threefold.ops import families as fam
from threefold.ops.rules import Decision, Registry, refuse
from threefold.passes.tp_placement import Shard

__all__ = ["ParamCut", "REDUCE", "REGISTRY", "ReduceScatter", "TpCall", "TpDecision", "refuse"]

# a follow-up step (Decision.then): all-reduce the partial sum RESULT (Megatron's g)
REDUCE = "all_reduce"

# random ops draw per element: on a shard they would draw other numbers than one process
# (dropout has its own rule, tp_ops.tp_dropout)
REGISTRY = Registry("tp", skip_family=lambda name: name in fam.RANDOM)


@dataclass(frozen=True)
class ParamCut:
    """A parameter cut over tp: on `dim`, block by block for a fused projection (`blocks`),
    padded to `pad` rows; `whole`: per block, whether every rank holds it whole."""
    fqn: str
    dim: int
    blocks: tuple = ()
    pad: int = 0
    whole: tuple = ()


@dataclass(frozen=True)
class ReduceScatter:
    """A follow-up step (Decision.then): reduce-scatter the partial sum RESULT over `dim`
    (sequence parallelism's g)."""
    dim: int


@dataclass(frozen=True, eq=False)
class TpDecision(Decision):
    """uses: "sharded" / "whole" when the call applies replicated parameters (or values of
    them alone, Gemma's 1 + weight) to shards / to whole values: applied to shards, each rank
    holds a part of their gradient, which the runtime sums over tp. `skip`: inputs the call
    cuts (their gradient is made whole by the cut's backward).

    A matmul with a parameter (tp_weights, tp_einsum, tp_pieces) also decides the parameter:
    cuts:   the parameter cuts it needs (checked against the cuts already decided when the
            decision is written: a tied weight cut two ways falls back)
    kept:   (fqn, why) of parameters it keeps whole on every rank; whole_uses: parameters it
            applies whole (a later cut of them is refused)
    origin: the column weights whose shards the output is (blamed when they reach a fallback)
    notes:  what it tells the user (padding); padded: (fqn, how) of parameters padded for tp
    first:  inputs brought before the others
    seq_len: the true sequence length of an output padded for sp"""
    uses: str | None = None
    skip: frozenset = frozenset()
    cuts: tuple = ()
    kept: tuple = ()
    whole_uses: frozenset = frozenset()
    origin: frozenset | None = None
    notes: tuple = ()
    first: tuple = ()
    seq_len: int | None = None
    padded: tuple = ()


@dataclass(frozen=True, eq=False)
class TpCall:
    """One call as a tp rule sees it (read only)."""
    node: fx.Node                 # the source graph's call
    name: str                     # its op name (families.op_name)
    args: dict                    # its arguments by schema name (source nodes, constants)
    t: int                        # the tp degree
    places: Mapping = field(default_factory=dict)   # source input -> its placement on tp now
    locals: Mapping = field(default_factory=dict)   # source input -> its local value (meta)

    def place(self, x):
        return self.places.get(x) if isinstance(x, fx.Node) else None

    def shard(self, x) -> Shard:
        """x's shard; refuses when x is not sharded."""
        p = self.place(x)
        if not isinstance(p, Shard):
            refuse(f"reads a value placed {p}")
        return p

    def local(self, x):
        return self.locals[x]

    def rank(self, x) -> int:
        return len(self.locals[x].shape)

    @property
    def x(self):
        """The first tensor argument (self / input)."""
        for k in ("self", "input"):
            if isinstance(self.args.get(k), fx.Node):
                return self.args[k]
        return self.node.args[0] if self.node.args else None

    @property
    def out(self):
        """The call's traced (global) value."""
        return self.node.meta["val"]


def global_val(x: fx.Node):
    """A source value's traced (global) value."""
    return x.meta["val"]


def meta_like(v) -> torch.Tensor:
    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
