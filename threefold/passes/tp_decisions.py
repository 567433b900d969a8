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

__all__ = ["REDUCE", "REGISTRY", "TpCall", "TpDecision", "refuse"]

# a follow-up step (Decision.then): all-reduce the partial sum RESULT (Megatron's g)
REDUCE = "all_reduce"

# random ops draw per element: on a shard they would draw other numbers than one process
# (dropout has its own rule, tp_ops.tp_dropout)
REGISTRY = Registry("tp", skip_family=lambda name: name in fam.RANDOM)


@dataclass(frozen=True, eq=False)
class TpDecision(Decision):
    """uses: "sharded" / "whole" when the call applies replicated parameters (or values of
    them alone, Gemma's 1 + weight) to shards / to whole values: applied to shards, each rank
    holds a part of their gradient, which the runtime sums over tp. `skip`: inputs the call
    cuts (their gradient is made whole by the cut's backward)."""
    uses: str | None = None
    skip: frozenset = frozenset()


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
