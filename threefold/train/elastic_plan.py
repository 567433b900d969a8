"""The plan a restarted job runs on when it has fewer ranks than before, derived from the old one.

Data-parallel replicas shrink first: tp, pp, cp and ep stay (the model is cut the same way,
each replica holds what it held), dp drops to what the ranks allow, and the global batch
and the learning-rate schedule stay, so the run is the same optimisation: each replica
takes more rows, in more microbatches of the same size where they divide (m grows by
the factor dp shrank), else the largest m that divides the replica's rows. Only when no
dp fits the ranks does the shape itself change: every smaller (tp, pp) whose divisors of
the old ones fit the ranks is a candidate, ranked by the planner (planner/estimate.py's
performance model prices each candidate plan for the model and the global batch; those
that fit memory first, then by predicted time per iteration), or without a model cost
in the fixed order pp, then tp, halved. The caller compiles each candidate in that order
and takes the first that works (the compiler says whether the model can be cut that way).
The same data order follows from the sampler, whose position counts global batches
(dataset/sampler.py), not ranks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from threefold.errors import PlanError
from threefold.plan import Plan


def _with_dp(old: Plan, dp: int, batch: int | None, **shape) -> Plan | None:
    """`old` with dp replicas (and `shape`'s axes), m adjusted for `batch` rows; None if it cannot be."""
    fields = {**shape, "dp": dp}
    ep = shape.get("ep", old.ep)
    if dp % ep:
        return None
    if old.dp_shard is not None:
        fields["dp_shard"] = old.dp_shard if dp % old.dp_shard == 0 and old.dp_shard % ep == 0 else None
    m = old.microbatches
    if batch is not None:
        if batch % dp:
            return None
        rows = batch // dp
        micro = max(1, batch // (old.dp * old.microbatches))   # rows per microbatch, as before
        want = max(1, rows // micro)
        m = max(d for d in range(1, want + 1) if rows % d == 0)
    fields["microbatches"] = m
    try:
        return dataclasses.replace(old, **fields)
    except PlanError:
        return None


def _reshaped(old: Plan, w: int, batch: int | None, tp: int, pp: int) -> Plan | None:
    """`old` cut as tp x pp on w ranks (dp what is left, m for the batch); None if it cannot be."""
    shape = {"tp": tp, "pp": pp}
    if pp == 1:
        shape.update(interleave=1, schedule="1f1b")
    elif old.interleave > 1 and pp != old.pp:
        shape.update(interleave=1, schedule="1f1b" if old.schedule in ("interleaved", "zbv") else old.schedule)
    try:
        rest = dataclasses.replace(old, dp=1, microbatches=1, dp_shard=None, **shape).world_size
    except PlanError:
        return None
    return _with_dp(old, w // rest, batch, **shape) if w % rest == 0 else None


def fixed_order(old: Plan, w: int, batch: int | None) -> list[tuple[Plan, str]]:
    """The shapes for w ranks with pp, then tp, halved (each halving alone)."""
    out = []
    for axis in ("pp", "tp"):
        value = getattr(old, axis)
        while value > 1:
            value //= 2
            plan = _reshaped(old, w, batch, value if axis == "tp" else old.tp, value if axis == "pp" else old.pp)
            if plan is not None:
                out.append((plan, f"{axis} {getattr(old, axis)} -> {value}: no dp fits {w} ranks"))
    return out


def reshapes(old: Plan, w: int, batch: int | None) -> list[Plan]:
    """Every plan for w ranks that cuts the model smaller: tp and pp divisors of the old ones
    (not both the old), dp what is left."""
    out = []
    for tp in (d for d in range(old.tp, 0, -1) if old.tp % d == 0):
        for pp in (d for d in range(old.pp, 0, -1) if old.pp % d == 0):
            if (tp, pp) != (old.tp, old.pp):
                plan = _reshaped(old, w, batch, tp, pp)
                if plan is not None:
                    out.append(plan)
    return out


def planner_order(plans: list[Plan], model, batch: int, cluster, dtype: str = "bf16") -> list[tuple[Plan, str]]:
    """`plans` ranked by the planner's performance model (planner/estimate.py) for `model`
    (a ModelCost) and the global batch: those that fit memory first, then by predicted
    time per iteration; each with why (its prediction next to the runner-up's)."""
    # lazy: start-up: threefold.planner.estimate loads 8 more modules only when this runs
    from threefold.planner.estimate import Config, estimate
    priced = []
    for plan in plans:
        try:
            e = estimate(model, Config(plan, batch), cluster, dtype)
        except (PlanError, ValueError, ZeroDivisionError):
            continue        # a plan the model cannot price: the compiler still gets the last word
        priced.append((not e.fits, e.model_s or e.iteration_s, plan.tp * plan.pp, str(plan), plan, e))
    priced.sort(key=lambda t: t[:4])
    out = []
    for i, (_, seconds, _, _, plan, e) in enumerate(priced):
        other = priced[1] if i == 0 and len(priced) > 1 else (priced[0] if i else None)
        versus = (f" vs {other[1]:.3g} s for tp={other[4].tp},pp={other[4].pp}" if other else "")
        out.append((plan, f"the planner's pick for {model.name} on {cluster.name}: tp {plan.tp}, pp {plan.pp} "
                          f"predicted {seconds:.3g} s per iteration{' (fits)' if e.fits else ' (does not fit)'}"
                          f"{versus}; no dp of the old shape fits {plan.world_size} ranks"))
    return out


def smaller_plans(old: Plan, world: int, min_world: int, batch: int | None,
                  rank=None) -> Iterator[tuple[Plan, str]]:
    """(plan, why) for the largest worlds first, from `world` ranks down to `min_world`; on
    each world the dp shrink first, then the reshaped plans: ranked by `rank(plans, w)`
    (planner_order over a model cost) when given, else in the fixed order."""
    per_replica = old.world_size // old.dp
    for w in range(world, max(min_world, 1) - 1, -1):
        if w % per_replica == 0 and w // per_replica <= old.dp:
            plan = _with_dp(old, w // per_replica, batch)
            if plan is not None:
                yield plan, f"dp {old.dp} -> {plan.dp}, m {old.microbatches} -> {plan.microbatches} (global batch kept)"
        cuts = reshapes(old, w, batch)
        ranked = rank(cuts, w) if rank is not None and cuts else []
        yield from (ranked or fixed_order(old, w, batch))


def plan_for_world(old: Plan, world: int, batch: int | None, rank=None) -> tuple[Plan, str]:
    """The first plan for exactly `world` ranks (torchrun fixed the world), or a PlanError."""
    for plan, why in smaller_plans(old, world, world, batch, rank):
        return plan, why
    raise PlanError(f"no plan for {world} ranks derives from plan {old} (its tp*pp*cp="
                    f"{old.world_size // old.dp} ranks per replica): restart with a multiple of it")
