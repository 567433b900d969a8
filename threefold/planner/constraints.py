"""`Constraints`: a partial plan the search must match (`threefold plan --evaluate tp=8,pp=64`).

The text is `threefold.Plan`'s grammar (`Plan.parse_fields`: the same keys, aliases and
values, so `str(plan)` of any plan the planner printed parses back and re-scores it),
read as a partial plan: keys left out are free. One key is added, `b`, the microbatch
size, which a Plan does not store because it is derived from the global batch
(b = batch / (dp * m)); `b` constrains that derived value.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from threefold.errors import PlanError
from threefold.plan import _SHORT as PLAN_SPELLING
from threefold.plan import Plan

# Plan fields the planner searches over; the performance model assumes the others' defaults.
SEARCHED = ("tp", "pp", "dp", "microbatches", "interleave", "recompute", "schedule", "zero", "ep")
# Plan fields it models at one value only (Megatron's setting), and that value.
ASSUMED = {"sp": False, "scatter_gather": True}
MODELLED_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
_SHORT = {**PLAN_SPELLING, "microbatch_size": "b"}   # Plan's short keys (m, v), and b


@dataclass(frozen=True)
class Constraints:
    """Plan fields to match; None leaves a choice free. `microbatch_size` is derived (b)."""
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    microbatches: int | None = None
    interleave: int | None = None
    recompute: bool | str | None = None   # True/False = full/none, or "selective"
    zero: int | None = None         # ZeRO stage 0..3 (1: AdamW state, 2: + gradients, 3: + parameters over dp)
    schedule: str | None = None     # 1f1b (v=1) or interleaved (any v)
    ep: int | None = None           # expert parallelism (MoE models; 1 for the others)
    microbatch_size: int | None = None

    @classmethod
    def parse(cls, text: "str | Constraints | None") -> "Constraints":
        """A partial plan in Plan's grammar, plus b=N (microbatch size)."""
        if isinstance(text, Constraints):
            return text
        plan_items, b = [], None
        for item in str(text or "").replace(" ", "").split(","):
            key, eq, value = item.partition("=")
            if key == "b" and eq:
                b = _positive(value)
            elif item:
                plan_items.append(item)
        given = Plan.parse_fields(",".join(plan_items))   # the plan grammar: PlanError on bad keys/values
        for name, value in given.items():
            if isinstance(value, int) and not isinstance(value, bool) and value < 1 and name != "zero":
                raise PlanError(f"plan {_key(name)}={value!r} is invalid: it must be a positive integer")
            if name in ASSUMED and value == ASSUMED[name]:
                continue
            if name not in SEARCHED:
                raise PlanError(f"plan key {_key(name)}={value!r} cannot be evaluated by the planner: it models "
                                "tp, pp, dp, m, b (microbatch size), v, schedule, recompute, zero and ep"
                                + (f" with {name}={str(ASSUMED[name]).lower()}" if name in ASSUMED else ""))
        schedule = given.get("schedule")
        if schedule is not None and schedule not in MODELLED_SCHEDULES:
            raise PlanError(f"plan schedule={schedule!r} cannot be evaluated: the planner models "
                            "1f1b, interleaved, zb-h1 and zbv; use one of those")
        if given.get("recompute") in ("full", "none"):   # full/none read as booleans; selective stays a mode
            given["recompute"] = given["recompute"] == "full"
        return cls(microbatch_size=b, **{k: v for k, v in given.items() if k in SEARCHED})

    def admits(self, plan: Plan, microbatch_size: int) -> bool:
        if self.schedule == "1f1b" and plan.interleave != 1:
            return False
        # a zero-bubble schedule is asked for by name; 1f1b/interleaved exclude them
        zero_bubble = ("zb-h1", "zbv")
        if (self.schedule in zero_bubble or plan.schedule in zero_bubble) and self.schedule not in (None, plan.schedule):
            return False
        if self.microbatch_size is not None and self.microbatch_size != microbatch_size:
            return False
        def planned(k):  # Plan.recompute is a mode; a boolean constraint means full (True) or none
            if k == "recompute" and isinstance(self.recompute, bool):
                return plan.recompute == "full"
            return getattr(plan, k)
        return all(getattr(self, k) is None or getattr(self, k) == planned(k)
                   for k in SEARCHED if k != "schedule")

    def __str__(self) -> str:
        """The given keys in Plan's spelling (m, v), b for the microbatch size."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out.append(f"{_key(f.name)}={str(value).lower() if isinstance(value, bool) else value}")
        return ",".join(out)


def _key(name: str) -> str:
    return _SHORT.get(name, name)


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise PlanError(f"plan b={value!r} is invalid: the microbatch size must be a positive integer")
    return number
