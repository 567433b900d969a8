"""What a plan string leaves out, filled in: the one rule every entry point uses.

`threefold.parallelize` and the commands `train`, `check`, `compile` and `inspect` pass the
user's plan text through `resolve_plan` (the compiler's own `threefold.compile` takes a plan
as written, as `Plan.parse` reads it). A key the text gives is never changed; a `Plan`
value is used exactly as built. Two keys are filled in:

* **dp** (data-parallel replicas), when not given and the number of ranks is known (the
  process group's world size in `parallelize`, torchrun's WORLD_SIZE for the commands):
  dp = ranks / (tp*cp*pp), so `pp=2` on 4 ranks is pp=2,dp=2. Where tp*cp*pp does not divide the
  ranks, dp stays 1 and the world-size check says what is wrong. Without a known world
  (local runs of the commands, which start tp*cp*pp*dp ranks), dp = 1.
* **m** (microbatches), when not given and pp > 1: 2*pp. A pipeline needs m > 1 to overlap
  its stages at all (m = 1 leaves pp-1 of every pp stage-steps idle); with 1F1B the bubble
  is (pp-1)/(m+pp-1) of the step, 1/3 at m = 2*pp against 1/2 at m = pp, while the
  activations in flight stay min(m, pp) microbatches, so doubling past pp costs no memory,
  only smaller microbatches. For pp = 2 it is the default job's m=4. When the batch's rows
  per dp replica are known and 2*pp does not divide them, m is the largest number below
  2*pp that does, and a note says so. With pp = 1, m stays 1 (nothing to overlap).
An m or dp the text gives that does not fit (m not dividing the batch, dp*tp*pp not the
world) stays the error it was, naming the value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.plan import Plan


@dataclass(frozen=True)
class ResolvedPlan:
    plan: Plan
    notes: tuple[str, ...] = ()    # what was chosen for the user, when it was not the plain rule


def default_microbatches(pp: int) -> int:
    """m when the plan does not give it: 2*pp for a pipeline, 1 without one."""
    return 2 * pp if pp > 1 else 1


def resolve_plan(plan, world: int | None = None, batch: int | None = None) -> ResolvedPlan:
    """The plan `plan` (text, a Plan, or None) names, with dp from `world` ranks and m from
    `batch` global rows where the text leaves them out (see the module docstring)."""
    if isinstance(plan, Plan):
        return ResolvedPlan(plan)
    given = Plan.parse_fields(plan or "")
    notes: list[str] = []
    if "dp" not in given and world is not None:
        # tp*pp (and any other non-data axis): the ranks of one data-parallel replica
        per_replica = Plan(**{k: v for k, v in given.items() if k not in ("dp", "dp_shard", "ep")}).world_size
        if world % per_replica == 0:
            given["dp"] = world // per_replica
    base = Plan(**given)
    if "microbatches" not in given and base.pp > 1:
        m = default_microbatches(base.pp)
        if batch is not None and batch % base.dp == 0:
            rows = batch // base.dp
            fits = max(d for d in range(1, m + 1) if rows % d == 0)
            if fits != m:
                notes.append(f"m={fits}: the default m=2*pp={m} does not divide the batch's {rows} rows per "
                             f"dp replica; give m= to choose")
                m = fits
        given["microbatches"] = m
    plan = Plan(**given)
    if plan.zero and plan.shard_degree == 1:
        notes.append(f"zero={plan.zero} shards over the dp ranks, and there is {plan.dp}: nothing is sharded "
                     "(it runs as zero=0); set dp>1 to shard")
    return ResolvedPlan(plan, tuple(notes))


def batch_rows(inputs, batch_dims=None) -> int | None:
    """The global batch's row count: the declared batch dim of the first tensor input that
    has one, else dim 0 of the first tensor input (what passes/batch_dims.py prefers)."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    dims = batch_dims if isinstance(batch_dims, (tuple, list)) else [batch_dims] * len(inputs)
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        d = dims[i] if i < len(dims) else None
        if batch_dims is not None and d is None:
            continue          # declared unsplit
        return int(t.shape[d if d is not None else 0])
    return None
