"""Context parallelism's sequence rules: one pure function per op or op family.

Each value is one of: not along the sequence (None: parameters, constants, values of them),
split along the sequence at dim d (`Seq(d)`: this rank holds its positions' rows there; a
dim that merges the sequence with its neighbours, [b*s, h] after a flatten, counts too, its
positions a digit of size n with `inner` elements inside each), or
a partial sum over this rank's tokens (`PARTIAL`: the loss numerator, summed over the batch
axes by the runtime).

A rule reads one call (`Call`: the op's name, its arguments by schema name, the input
placements, the traced shapes) and returns a decision: `Place(out)` (the output's
placement; with `op`, the call this rank runs instead), `Gather(why)` (it mixes positions; exact on the all-gathered sequence,
passes/cp_fallback.py) or `Refuse(why)` (a PlanError naming the op and the fix). Rules never
touch the graph: the sharding walker applies the decisions (passes/shard.py, with cp's hooks in
passes/context_parallel.py). Rules are registered by
op name (`RULES`) or by family (threefold/ops/families.py, `FAMILY_RULES`); `decision_for`
says, for any op name, which rule (or reasoned refusal) cp has for it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from typing import Callable

import torch.fx as fx

from threefold.ir.program import tf
from threefold.ops import families as fam
from threefold.ops.families import args_of, op_name
from threefold.ops.rules import Gather, Place, Refuse, Registry

__all__ = ["Seq", "PARTIAL", "Perm", "Ptr", "RANK_LOCAL", "is_local", "Call", "Place", "Gather", "Refuse", "decide", "decision_for", "op_name",
           "RULES", "FAMILY_RULES", "REFUSALS", "GATHERABLE", "rule", "where"]


@dataclass(frozen=True)
class Seq:
    dim: int
    inner: int = 1     # elements of `dim` inside each position (1: positions are the innermost digit)

    def at(self, dim: int) -> "Seq":
        """The same positions, moved to `dim`."""
        return Seq(dim, self.inner)


PARTIAL = "partial"


@dataclass(frozen=True)
class Perm:
    """This rank's rows along `dim` in the order a sort (`key`, the sort node) put them: a
    routing sort over tokens (MoE: token-expert rows by expert). Exact as long as every op
    treats rows alone until they are put back in token order (cp_rules/permutations.py).
    `src` is the sorted value's Seq placement; `ptr`: the values are row numbers into it."""
    dim: int
    key: object
    src: Seq
    ptr: bool = False

    def at(self, dim: int) -> "Perm":
        return Perm(dim, self.key, self.src, self.ptr)


@dataclass(frozen=True)
class Ptr:
    """Laid out as `seq` (token order); the values are row numbers into Perm(key) rows (the
    inverse permutation)."""
    seq: Seq
    key: object


# A value made from this rank's rows alone but not along the sequence (rows per expert, the
# expert matmul's offsets): it differs between ranks, so it may only meet Perm rows.
RANK_LOCAL = "rank-local"


def is_local(p) -> bool:
    return isinstance(p, (Perm, Ptr)) or p == RANK_LOCAL


# Place(Seq | PARTIAL | None, or a tuple of them), Gather(why: mixes positions: run on the
# gathered sequence, cut back), Refuse(why, table: the whole operand that varies per position,
# where that is why): the decisions every axis on the sharding walker returns (ops/rules.py).


@dataclass(frozen=True)
class Call:
    """One op call as a rule sees it (read only)."""
    node: fx.Node
    name: str
    args: dict             # by schema name, defaults filled
    state: dict            # node -> placement of what ran before
    stage: object          # plan (cp), seq_len, read only

    def place(self, x):
        return self.state.get(x) if isinstance(x, fx.Node) else None

    @property
    def out(self):
        return self.node.meta.get("val")

    @property
    def x(self):
        """The first tensor argument (self / input)."""
        for k in ("self", "input", "x"):
            if k in self.args:
                return self.args[k]
        return self.node.args[0] if self.node.args else None


class _NoRule(Exception):
    def __init__(self, why: str, table=None):
        super().__init__(why)
        self.table = table


def _fail(call: Call, why: str, table=None):
    raise _NoRule(why, table)


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _norm(d, rank):
    return d % rank if rank else d


# -- registry --------------------------------------------------------------------------------

REGISTRY = Registry("cp")                # the registry mechanics every axis shares (ops/rules.py)
RULES: dict[str, Callable] = REGISTRY.by_name           # op name -> rule
FAMILY_RULES: dict[str, Callable] = REGISTRY.by_family  # family -> rule
REFUSALS: dict[str, str] = REGISTRY.refusals            # op name -> why cp has no rule (reasoned refusal)
# families whose ops are exact on the gathered sequence when no position-wise rule applies
GATHERABLE = {"reduction", "softmax", "scan", "sort", "conv", "pool", "matmul", "pad", "attention"}
ROWS_RULE: list = []   # the rule for calls that read Perm / Ptr / RANK_LOCAL values (permutations.py)

rule = REGISTRY.rule


def decision_for(name: str, node: fx.Node | None = None):
    """The rule cp applies to op `name` (a function), or the reason it has none (a str)."""
    if name in RULES:
        return RULES[name]
    f = fam.family(node if node is not None else name)
    if f in FAMILY_RULES:
        return FAMILY_RULES[f]
    if name in REFUSALS:
        return REFUSALS[name]
    base = name[:-1] if name.endswith("_") else name
    if base != name and (base in RULES or fam.family(base) in FAMILY_RULES):
        return decision_for(base)                          # in-place variants (add_, clamp_) follow theirs
    return "has no context-parallel rule (it may mix sequence positions)"


def decide(node: fx.Node, state: dict, stage):
    """The decision for one call whose inputs include a sequence-split or partial value."""
    name = op_name(node)
    call = Call(node, name, args_of(node) if node.op == "call_function" else {}, state, stage)
    if any(state.get(a) == PARTIAL for a in node.all_input_nodes) and node.target is not operator.getitem:
        return _partial(call)
    if ROWS_RULE and any(is_local(state.get(a)) for a in node.all_input_nodes):
        return _decided(ROWS_RULE[0], call, "")
    r = decision_for(name, node)
    if isinstance(r, str):
        return Gather(r) if fam.family(node) in GATHERABLE else Refuse(r)
    return _decided(r, call, fam.family(node))


def _decided(r, call: Call, family):
    name = call.name
    try:
        d = r(call)
    except _NoRule as exc:
        return Gather(str(exc)) if family in GATHERABLE else Refuse(str(exc), exc.table)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:   # arguments it cannot read
        why = f"has arguments cp's {name} rule cannot read ({type(exc).__name__}: {exc})"
        return Gather(why) if family in GATHERABLE else Refuse(why)
    return d if isinstance(d, (Place, Gather, Refuse)) else Place(d)


def _partial(call: Call):
    """A per-rank partial loss sum may only be scaled, cast or viewed (it is summed later)."""
    n = call.node
    ins = n.all_input_nodes
    linear = {"mul", "div", "neg", "add", "sub", "squeeze", "unsqueeze"} | fam.VIEWS | fam.COPIES
    if call.name in linear and sum(call.place(a) == PARTIAL for a in ins) == 1 \
            and not any(isinstance(call.place(a), Seq) or is_local(call.place(a)) for a in ins):
        if call.name in ("add", "sub") and any(isinstance(a, fx.Node) and call.place(a) is None and _val(a) is not None
                                               for a in n.args[:2]):
            return Refuse("adds a whole value to a per-rank partial loss")
        return Place(PARTIAL)
    return Refuse("reads a partial (per-rank) loss sum")


REFUSALS.update({
    "scaled_dot_product_attention": "is attention the ring did not take over",
    "call_loss": "is a loss run as Python (untraceable): cp cannot tell how it reduces over the sequence",
})



def where(node: fx.Node) -> str:
    return tf(node).get("module") or "<top>"
