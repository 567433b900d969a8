"""The JSON form of one ranked plan: the `threefold plan --json` schema."""
from __future__ import annotations

from threefold.planner.estimate import Estimate


def plan_record(e: Estimate) -> dict:
    """Sizes and predictions of one estimate; "plan" is `str(threefold.Plan)`, which
    `Plan.parse` reads back (and `--evaluate` re-scores)."""
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
        # held at the best measured efficiency of the cluster's device (Cluster.measured_best_fraction)
        "capped_at_measured_best": e.capped,
        "model_tflops_per_gpu": round(e.flops_per_iteration / (e.model_s or e.iteration_s) / c.plan.world_size / 1e12, 3),
        "iteration_s": e.iteration_s,
        "samples_per_s": e.samples_per_s,
        "time_shares": {k: round(v, 6) for k, v in e.shares.items()},
        "recompute_mode": c.plan.recompute,       # none | selective | full ("recompute": full)
        "zero": c.plan.zero,
        "ep": c.plan.ep,
        "mesh": c.plan.mesh.to_json(),            # the named axes, outermost first
        "plan": str(c.plan),
    }
