"""The rule registry every sharding axis shares: one pure function per op (or per op family,
threefold/ops/families.py) and per axis, returning a decision.

A rule reads one call (the op, its arguments by schema name, its inputs' placements on the
axis, their shapes) and returns a `Decision` (the output's placement, the placements it
needs its inputs in, and optionally a substitute op to run instead) or `NoRule(why)`. It
never touches the graph: the axis's pass brings the inputs to the placements asked for
(one redistribution step), emits the (substitute) op and records the output's placement;
on `NoRule` it runs the op on whole inputs and records the fallback for `inspect`.

Lookup order for an op name: a rule registered under the name, then under the op's family,
then (for in-place variants, `add_`) the out-of-place op's rule where it is marked
`in_place` (elementwise: the same on a shard; a view's in-place variant is not), then a registered
refusal (a reason), else none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from threefold.ops import families as fam

__all__ = ["Decision", "Gather", "NoRule", "Op", "Place", "RESULT", "Refuse", "Refused", "Registry", "refuse"]


class _Result:
    """In a follow-up step's arguments: the value the previous step produced."""
    def __repr__(self):
        return "RESULT"


RESULT = _Result()


@dataclass(frozen=True, eq=False)
class Op:
    """A call to emit: `target(*args, **kwargs)`. Tensor arguments are the source graph's
    nodes (the pass maps them to their redistributed values) or RESULT. `place` is the
    result's placement on the axis (None: the decision's `out`); `val` its local value where
    the pass cannot compute it from the inputs' (a runtime op on meta tensors); `name` the
    name the emitted node takes (a row-parallel matmul's `{name}_partial`)."""
    target: object
    args: tuple
    kwargs: dict = field(default_factory=dict)
    place: object = None
    val: object = None
    collective: object = None
    name: str | None = None    # the emitted node's name (None: the pass names it)


@dataclass(frozen=True, eq=False)
class Decision:
    """What a rule decided for one call on one axis.

    out:     the output's placement (a list of them for several outputs)
    needs:   input node -> how it must arrive (the axis's redistribution vocabulary);
             inputs not named are taken as placed
    op:      what runs instead of the call (None: the call itself, on the inputs as they
             arrive); then: further steps on its RESULT (a reduction's all-reduce)
    same_as: the output is this input, unchanged (nothing is emitted)
    """
    out: object
    needs: dict = field(default_factory=dict)
    op: Op | None = None
    then: tuple = ()
    same_as: fx.Node | None = None


@dataclass(frozen=True)
class NoRule:
    """No rule splits this call with its inputs placed so: the pass falls back (and says why)."""
    why: str


# The decisions the sharding walker applies (passes/shard.py) for the axes on it (cp, the
# batch axes, ep): a value's state on the axis, run on whole inputs, or refused.
@dataclass(frozen=True)
class Place:
    out: object            # the output's state on the axis (a tuple of them for several outputs)
    op: "Op | None" = None  # what this rank runs instead, on the same arguments' nodes (a scan's carry)


@dataclass(frozen=True)
class Gather:
    why: str               # no split rule: run on whole inputs (the axis's redistribution), cut back


@dataclass(frozen=True)
class Refuse:
    why: str
    table: object = None   # the operand that is why, where the axis's `retry` may rewrite it


class Refused(Exception):
    """Raised by `refuse` inside a rule (or a helper it calls); `Registry.decide` turns it
    into NoRule."""


def refuse(why: str):
    raise Refused(why)


class Registry:
    """One axis's rules: by op name, by family, and reasoned refusals."""

    def __init__(self, axis: str, skip_family: Callable[[str], bool] = lambda name: False):
        self.axis = axis
        self.by_name: dict[str, Callable] = {}
        self.by_family: dict[str, Callable] = {}
        self.refusals: dict[str, str] = {}
        self.skip_family = skip_family     # names a family rule does not cover (random ops)
        self.in_place: set[Callable] = set()   # rules that also cover `name_` (add_, clamp_)

    def rule(self, *names: str, family: str | None = None, in_place: bool = False):
        def register(fn):
            for n in names:
                self.by_name[n] = fn
            if family:
                self.by_family[family] = fn
            if in_place:
                self.in_place.add(fn)
            return fn
        return register

    def lookup(self, name: str, node: fx.Node | None = None):
        """The rule for op `name` (a node gives the overload's family: max.other is
        pointwise), or the reason there is none (a str), or None."""
        if name in self.by_name:
            return self.by_name[name]
        if self.by_family:
            f = fam.family(node if node is not None else name)
            if f in self.by_family and not self.skip_family(name):
                return self.by_family[f]
        base = name[:-1] if name.endswith("_") else name
        if base != name and self.in_place:
            r = self.lookup(base)
            if r in self.in_place:
                return r
        return self.refusals.get(name)

    def names(self) -> set[str]:
        """Every op name with a rule of its own or through its family."""
        out = set(self.by_name)
        for f in self.by_family:
            out |= {n for n in fam.FAMILIES.get(f, ()) if not self.skip_family(n)}
        return out

    def decide(self, name: str, node: fx.Node | None, call) -> Decision | NoRule | None:
        """Ask the rule for `name` about `call`; None when the axis has no rule at all."""
        r = self.lookup(name, node)
        if r is None:
            return None
        if isinstance(r, str):
            return NoRule(r)
        try:
            d = r(call)
        except Refused as exc:
            return NoRule(str(exc))
        return d
