"""The performance model's one fitted constant, fitted in code: `matmul_fraction` of a cluster
by least squares against measured runs (for the A100 preset: the paper's Table 1 and its
GPT-3 175B figure, `paper_table1.MEASURED_ROWS`).

Each measured row is (params B, heads, hidden, layers, tp, pp or None, GPUs, batch, TFLOP/s
per GPU). Its prediction is the planner's fastest plan with the row's tp and pp (pp chosen
when None) and full recomputation, as the paper ran; b, v, schedule and ZeRO are left to the
search, and the figure is the model's own (before the measured ceiling, which would hide the
error it is there to bound). The fit minimises the sum over rows of log(predicted /
measured)^2: relative errors, each row weighted alike. Each row's prediction only grows with
the fraction, so the sum is scanned on a 0.05 grid and refined by golden section inside the
best grid cell; the result is deterministic (`bench/planner_table1.py --fit` prints it and
the per-row errors before and after, and a test checks the preset holds the fitted value).
"""
from __future__ import annotations

import dataclasses
import math

from threefold.planner.cluster import Cluster
from threefold.planner.constraints import Constraints
from threefold.planner.gpt_cost import gpt_model_cost
from threefold.planner.paper_table1 import SEQ, VOCAB


def row_prediction(row: tuple, cluster: Cluster, dtype: str = "bf16"):
    """The planner's estimate of a measured row's run: its tp (and pp) with recomputation,
    the rest searched; the fastest by the model's own time."""
    # lazy: start-up: threefold.planner.search loads 7 more modules only when this runs
    from threefold.planner.search import rank_plans
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    model = gpt_model_cost(layers, hidden, heads, VOCAB, SEQ)
    plans = rank_plans(model, batch, gpus, cluster, dtype, where=Constraints(tp=tp, pp=pp, recompute=True))
    return plans[0]


def model_tflops(estimate) -> float:
    """TFLOP/s per GPU by the model's own sum (not held at the measured ceiling)."""
    c = estimate.config
    return estimate.flops_per_iteration / (estimate.model_s or estimate.iteration_s) / c.plan.world_size / 1e12


def row_errors(rows, cluster: Cluster) -> list[float]:
    """predicted / measured - 1 per row (the model's own figure)."""
    return [model_tflops(row_prediction(r, cluster)) / r[-1] - 1 for r in rows]


def loss(rows, cluster: Cluster, fraction: float) -> float:
    c = dataclasses.replace(cluster, matmul_fraction=fraction)
    return sum(math.log(1 + e) ** 2 for e in row_errors(rows, c))


def fit_matmul_fraction(rows, cluster: Cluster, lo: float = 0.40, hi: float = 0.95, tol: float = 1e-3,
                        step: float = 0.05) -> float:
    """The matmul_fraction in [lo, hi] minimising `loss` (a grid of `step`, then golden section
    inside the best cell's neighbours), to three decimals."""
    grid = [round(lo + step * i, 10) for i in range(int(round((hi - lo) / step)) + 1)]
    values = [loss(rows, cluster, f) for f in grid]
    i = min(range(len(grid)), key=values.__getitem__)
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    golden = (math.sqrt(5) - 1) / 2
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = loss(rows, cluster, c), loss(rows, cluster, d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = loss(rows, cluster, c)
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = loss(rows, cluster, d)
    return round((a + b) / 2, 3)
