"""Context parallelism's sequence rules: one pure function per op or op family.

core.py holds the placements (Seq, PARTIAL), the decisions (Place, Gather, Refuse), the
registry and `decide`; each family's rules live in one module (pointwise, shapes,
reductions, contractions, permutations: routing sorts), imported here so that they register.
"""
from threefold.passes.cp_rules.core import (FAMILY_RULES, GATHERABLE, PARTIAL, REFUSALS, RULES, Call, Gather,
                                            Place, Refuse, Seq, decide, decision_for, op_name, rule, where)
from threefold.passes.cp_rules import contractions, permutations, pointwise, reductions, shapes  # noqa: F401  (they register)

__all__ = ["Seq", "PARTIAL", "Call", "Place", "Gather", "Refuse", "decide", "decision_for", "op_name", "RULES",
           "FAMILY_RULES", "REFUSALS", "GATHERABLE", "rule", "where"]
