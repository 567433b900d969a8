"""The planner: choose tp, pp, dp, microbatch size, interleaving and recomputation.

The paper (Narayanan et al., SC'21) leaves these to intuition (its takeaways 1-3); here
they are decided by enumerating every legal configuration, pricing each with the
performance model (`perf_model.py`), dropping those that do not fit in GPU memory, and
ranking the rest by predicted time per iteration (i.e. by throughput). Nothing in the
ranking encodes a takeaway: tp inside a node, pp only as large as memory needs, and
interleaving at small batch sizes are what the costs produce (tests check that).

Legal means: tp*pp*dp = GPUs; tp divides the heads and the FFN width (Megatron pads the
vocabulary to a multiple of tp, so it does not constrain tp); tp
divides the GPUs of a node (unless tp may span nodes); pp <= layers; dp divides the
global batch and the microbatch size divides each replica's share; interleaving v > 1
needs pp > 1, layers divisible by pp*v, and a microbatch count divisible by pp
(Megatron's interleaved schedule).
"""
from __future__ import annotations

from dataclasses import dataclass

from threefold.compiler.cluster import Cluster
from threefold.compiler.perf_model import Config, Estimate, ModelCost, estimate
from threefold.errors import PlanError
from threefold.plan import Plan


_CONSTRAINT_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "b": "microbatch_size", "mbs": "microbatch_size",
                    "microbatch_size": "microbatch_size", "v": "interleave", "interleave": "interleave",
                    "recompute": "recompute", "m": "microbatches", "microbatches": "microbatches",
                    "schedule": "schedule"}


def divisors(n: int) -> list[int]:
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


@dataclass(frozen=True)
class Constraints:
    """A partial plan to match (`--evaluate tp=8,pp=64`); None leaves a choice free."""
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    microbatch_size: int | None = None
    interleave: int | None = None
    recompute: bool | None = None
    microbatches: int | None = None
    schedule: str | None = None     # 1f1b (v=1) or interleaved (any v)

    @classmethod
    def parse(cls, text: str | None) -> "Constraints":
        """'tp=8,pp=64' and any of dp, m, b (microbatch size), v (interleave), schedule, recompute.

        `str(plan)` of a runtime Plan parses too, so a plan the planner printed can be re-scored."""
        if isinstance(text, Constraints):
            return text
        fields: dict = {}
        for item in str(text or "").replace(" ", "").split(","):
            if not item:
                continue
            key, eq, value = item.partition("=")
            name = _CONSTRAINT_KEYS.get(key)
            if not eq or not value:
                raise PlanError(f"plan item {item!r} is malformed: write key=value, e.g. 'tp=8,pp=64'")
            if name is None:
                raise PlanError(f"plan key {key!r} cannot be evaluated by the planner: use tp, pp, dp, m, "
                                "b (microbatch size), v (interleave), schedule and recompute")
            if name == "schedule":
                if value.lower() not in ("1f1b", "interleaved"):
                    raise PlanError(f"plan schedule={value!r} cannot be evaluated: the planner models "
                                    "1f1b and interleaved (Megatron's schedules); use one of those")
                fields[name] = value.lower()
                continue
            if name == "recompute":
                low = value.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise PlanError(f"plan recompute={value!r} is invalid: use true or false")
                fields[name] = low in ("true", "1", "yes", "on")
                continue
            try:
                number = int(value)
            except ValueError:
                number = 0
            if number < 1:
                raise PlanError(f"plan {key}={value!r} is invalid: it must be a positive integer")
            fields[name] = number
        return cls(**fields)

    def admits(self, cfg: Config) -> bool:
        if self.schedule == "1f1b" and cfg.interleave != 1:
            return False
        return all(getattr(self, k) is None or getattr(self, k) == getattr(cfg, k)
                   for k in ("tp", "pp", "dp", "microbatch_size", "interleave", "recompute", "microbatches"))


def legal_configs(model: ModelCost, batch: int, gpus: int, cluster: Cluster,
                  tp_across_nodes: bool = False, where: Constraints = Constraints()):
    """Every legal Config for this model, batch and GPU count (see the module docstring)."""
    _check_inputs(batch, gpus, cluster, where)
    g = cluster.gpus_per_node
    for tp in divisors(gpus):
        if any(n % tp for n in model.tp_divides):
            continue
        if not tp_across_nodes and (tp > g or g % tp):
            continue
        for pp in divisors(gpus // tp):
            if pp > model.layers:
                continue
            dp = gpus // (tp * pp)
            if batch % dp:
                continue
            share = batch // dp
            vs = divisors(model.layers // pp) if pp > 1 and model.layers % pp == 0 else [1]
            for b in divisors(share):
                m = share // b
                for v in vs:
                    if v > 1 and m % pp:
                        continue
                    for recompute in (False, True):
                        cfg = Config(tp, pp, dp, b, v, recompute, batch)
                        if where.admits(cfg):
                            yield cfg


def _check_inputs(batch: int, gpus: int, cluster: Cluster, where: Constraints) -> None:
    for name, value in (("batch", batch), ("gpus", gpus)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{name}={value!r} is invalid: it must be a positive integer")
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
                        + (f" matching {describe(where)}" if where != Constraints() else "")
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
    return (float(f"{e.iteration_s:.9g}"), c.tp * c.pp, c.interleave, c.recompute, -c.microbatch_size)


def describe(where: Constraints) -> str:
    return ",".join(f"{k}={v}" for k, v in vars(where).items() if v is not None)


def to_plan(e: Estimate) -> Plan:
    """The runtime Plan for an estimate (microbatches = per-replica batch / microbatch size)."""
    c = e.config
    return Plan(tp=c.tp, pp=c.pp, dp=c.dp, microbatches=c.microbatches, interleave=c.interleave,
                schedule="interleaved" if c.interleave > 1 else "1f1b", recompute=c.recompute)


def plan_record(e: Estimate) -> dict:
    """The JSON form of one ranked plan (the `threefold plan --json` schema)."""
    c = e.config
    return {
        "tp": c.tp, "pp": c.pp, "dp": c.dp, "microbatch_size": c.microbatch_size,
        "interleave": c.interleave, "recompute": c.recompute,
        "predicted_tflops_per_gpu": round(e.tflops_per_gpu, 3),
        "memory_per_gpu_bytes": int(e.memory_bytes),
        "bubble_fraction": round(e.bubble_fraction, 6),
        "fits": e.fits,
        "microbatches": c.microbatches,
        "peak_fraction": round(e.peak_fraction, 6),
        "iteration_s": e.iteration_s,
        "samples_per_s": e.samples_per_s,
        "time_shares": {k: round(v, 6) for k, v in e.shares.items()},
        "plan": str(to_plan(e)),
    }
