"""The plan search: choose tp, pp, dp, microbatch size, interleaving and recomputation.

The paper (Narayanan et al., SC'21) leaves these to intuition (its takeaways 1-3); here
they are decided by enumerating every legal configuration, pricing each with the
performance model (`estimate.py`), dropping those that do not fit in GPU memory, and
ranking the rest by predicted time per iteration (i.e. by throughput). Nothing in the
ranking encodes a takeaway: tp inside a node, pp only as large as memory needs, and
interleaving at small batch sizes are what the costs produce (tests check that).

Legal means: tp*cp*pp*dp = GPUs (cp > 1 only for sequences of LONG_SEQUENCE tokens or more,
divisible by 2*cp, and without ZeRO); tp divides the heads and the FFN width (Megatron pads the
vocabulary to a multiple of tp, so it does not constrain tp); tp
divides the GPUs of a node (unless tp may span nodes); pp <= layers; dp divides the
global batch and the microbatch size divides each replica's share; interleaving v > 1
needs pp > 1, layers divisible by pp*v, and at least pp microbatches: the runtime's
interleaved order (runtime/schedule.py) keeps the bubble at (p-1)/(v m) for any m >= pp,
where Megatron's needs m divisible by pp. Zero-bubble schedules are candidates too: zb-h1
wherever 1F1B is (pp > 1), zbv wherever v=2 is (any m); they are priced by the paper's bubble forms
in the model's F, B and W times (planner/zero_bubble_time.py). Every
candidate is a `threefold.Plan`.
"""
from __future__ import annotations


from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.planner.cluster import Cluster
from threefold.planner.constraints import Constraints
from threefold.planner.estimate import Config, Estimate, estimate
from threefold.planner.model_cost import ModelCost
from threefold.runtime.schedule import SPLIT_KINDS


# Context parallelism (cp) is searched from this sequence length up: below it a sequence's
# activations are small next to the weights, and the search space stays what it was.
LONG_SEQUENCE = 16384


def divisors(n: int) -> list[int]:
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def legal_configs(model: ModelCost, batch: int, gpus: int, cluster: Cluster,
                  tp_across_nodes: bool = False, where: Constraints = Constraints()):
    """Every legal Config for this model, batch and GPU count (see the module docstring)."""
    _check_inputs(batch, gpus, cluster, where)
    g = cluster.gpus_per_node
    for tp, cp in ((t, c) for t in divisors(gpus) for c in divisors(gpus // t)):
        if any(n % tp for n in model.tp_divides):
            continue
        if not tp_across_nodes and (tp > g or g % tp):
            continue
        if cp > 1 and (model.seq_len < LONG_SEQUENCE or model.seq_len % (2 * cp)):
            continue
        for pp in divisors(gpus // (tp * cp)):
            if pp > model.layers:
                continue
            dp = gpus // (tp * cp * pp)
            if batch % dp:
                continue
            share = batch // dp
            vs = divisors(model.layers // pp) if pp > 1 and model.layers % pp == 0 else [1]
            for b in divisors(share):
                m = share // b
                for v in vs:
                    for recompute, schedule in ((r, s) for r in (False, "selective", True) for s in _schedules(pp, v)):
                        if v > 1 and m < pp and schedule == "interleaved":
                            continue
                        plan = Plan(tp=tp, pp=pp, dp=dp, microbatches=m, interleave=v, recompute=recompute,
                                    schedule=schedule, cp=cp)
                        if where.admits(plan, b):
                            yield Config(plan, batch)
                        for zero in ((1, 2, 3) if dp > 1 and cp == 1 else ()):   # ZeRO: what is sharded over dp
                            if where.admits(plan.replace(zero=zero), b):
                                yield Config(plan.replace(zero=zero), batch)
                        # experts over dp ranks; ZeRO shards over dp/ep (the runtime refuses ep
                        # with recompute: an expert region inside a recomputed segment)
                        for ep in (_ep_degrees(model, dp) if not recompute else ()):
                            for zero in ((0, 1, 2, 3) if dp > ep else (0,)):
                                if where.admits(plan.replace(ep=ep, zero=zero), b):
                                    yield Config(plan.replace(ep=ep, zero=zero), batch)


def _ep_degrees(model: ModelCost, dp: int) -> list[int]:
    """ep > 1 dividing dp and the expert count, for a model with MoE layers."""
    if model.moe is None:
        return []
    return [e for e in divisors(dp) if e > 1 and model.moe.experts % e == 0]


def _schedules(pp: int, v: int) -> tuple[str, ...]:
    """The schedules a (pp, v) admits: 1F1B and ZB-H1 with one chunk per stage, interleaved
    with more, and ZB-V with exactly two (zero bubble needs pp > 1 to mean anything)."""
    if pp == 1:
        return ("1f1b",)
    if v == 1:
        return ("1f1b", "zb-h1")
    return ("interleaved", "zbv") if v == 2 else ("interleaved",)


MAX_SEARCH = 1 << 24     # gpus and batch: 16.7 million, beyond any cluster built


def _check_inputs(batch: int, gpus: int, cluster: Cluster, where: Constraints) -> None:
    for name, value in (("batch", batch), ("gpus", gpus)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{name}={value!r} is invalid: it must be a positive integer")
        if value > MAX_SEARCH:    # the search walks the divisors: bounded, it ends in seconds
            raise PlanError(f"{name}={value} is more than the {MAX_SEARCH} this search considers: use at most "
                            f"{MAX_SEARCH}")
    g = cluster.gpus_per_node
    if gpus > g and gpus % g:
        raise PlanError(f"gpus={gpus} is not a whole number of {g}-GPU nodes ({cluster.name}): "
                        f"use a multiple of {g}")
    if gpus < g and g % gpus:
        raise PlanError(f"gpus={gpus} does not divide a {g}-GPU node ({cluster.name}): use a divisor of {g}")
    if where.tp and where.pp and gpus % (where.tp * where.pp):
        raise PlanError(f"gpus={gpus} is not divisible by tp*pp={where.tp * where.pp}: "
                        "choose tp and pp whose product divides the GPU count")
    if where.tp and where.pp and where.dp and where.tp * where.pp * where.dp != gpus:
        raise PlanError(f"plan tp*pp*dp={where.tp * where.pp * where.dp} does not equal gpus={gpus}: "
                        "drop dp to let the planner derive it, or fix the sizes")


def rank_plans(model: ModelCost, batch: int, gpus: int, cluster: Cluster, dtype: str = "bf16",
               tp_across_nodes: bool = False, where: Constraints = Constraints(),
               include_unfit: bool = False) -> list[Estimate]:
    """Estimates of every legal (matching) configuration, fastest first; unfit ones last
    (only when `include_unfit`)."""
    cluster.peak(dtype)  # unknown dtype -> PlanError before any work
    results = [estimate(model, cfg, cluster, dtype)
               for cfg in legal_configs(model, batch, gpus, cluster, tp_across_nodes, where)]
    if not results:
        raise PlanError(f"no legal plan for {model.name} with batch={batch} on gpus={gpus}"
                        + (f" matching {where}" if where != Constraints() else "")
                        + ": check that tp divides the heads and a node, and that dp divides the batch")
    fitting = [e for e in results if e.fits]
    fitting.sort(key=_order)
    if include_unfit:
        return fitting + sorted((e for e in results if not e.fits), key=_order)
    return fitting


def best_plan(model: ModelCost, batch: int, gpus: int, cluster: Cluster, **kw) -> Estimate:
    plans = rank_plans(model, batch, gpus, cluster, **kw)
    if not plans:
        raise PlanError(f"no plan for {model.name} fits in {cluster.usable_bytes / 2**30:.0f} GiB per GPU "
                        f"on gpus={gpus}: add GPUs, lower the batch, or use a larger-memory cluster")
    return plans[0]


def _order(e: Estimate):
    c = e.config
    # Fastest first (to 9 significant digits); ties go to less model parallelism, no
    # interleaving, no recompute, then larger microbatches (fewer, larger kernels).
    # by the model's own time: plans held at the measured ceiling keep their order
    return (float(f"{(e.model_s or e.iteration_s):.9g}"), c.tp * c.pp, c.interleave, c.plan.schedule in SPLIT_KINDS,
            c.recompute, c.plan.recompute != "none", c.plan.zero, c.plan.ep,
            -c.microbatch_size)
