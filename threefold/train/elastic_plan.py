"""The plan a restarted job runs on when it has fewer ranks than before, derived from the old one.

Data-parallel replicas shrink first: tp, pp, cp and ep stay (the model is cut the same way,
each replica holds what it held), dp drops to what the ranks allow, and the global batch
and the learning-rate schedule stay, so the run is the same optimisation: each replica
takes more rows, in more microbatches of the same size where they divide (m grows by
the factor dp shrank), else the largest m that divides the replica's rows. Only when no
dp fits the ranks does the shape itself change: pp, then tp, halved (the caller compiles
each candidate and takes the first that works: the compiler says whether the model can
be cut that way). The same data order follows from the sampler, whose position counts
global batches (dataset/sampler.py), not ranks.
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


def smaller_plans(old: Plan, world: int, min_world: int, batch: int | None) -> Iterator[tuple[Plan, str]]:
    """(plan, why) for the largest worlds first, from `world` ranks down to `min_world`; on
    each world the dp shrink first, then the shapes with pp, then tp, halved."""
    per_replica = old.world_size // old.dp
    for w in range(world, max(min_world, 1) - 1, -1):
        if w % per_replica == 0 and w // per_replica <= old.dp:
            plan = _with_dp(old, w // per_replica, batch)
            if plan is not None:
                yield plan, f"dp {old.dp} -> {plan.dp}, m {old.microbatches} -> {plan.microbatches} (global batch kept)"
        for axis in ("pp", "tp"):
            value = getattr(old, axis)
            while value > 1:
                value //= 2
                shape = {axis: value}
                if axis == "pp" and value == 1:
                    shape.update(interleave=1, schedule="1f1b")
                rest = dataclasses.replace(old, dp=1, microbatches=1, dp_shard=None, **shape).world_size
                if w % rest == 0:
                    plan = _with_dp(old, w // rest, batch, **shape)
                    if plan is not None:
                        yield plan, f"{axis} {getattr(old, axis)} -> {value}: no dp fits {w} ranks"


def plan_for_world(old: Plan, world: int, batch: int | None) -> tuple[Plan, str]:
    """The first plan for exactly `world` ranks (torchrun fixed the world), or a PlanError."""
    for plan, why in smaller_plans(old, world, world, batch):
        return plan, why
    raise PlanError(f"no plan for {world} ranks derives from plan {old} (its tp*pp*cp="
                    f"{old.world_size // old.dp} ranks per replica): restart with a multiple of it")
