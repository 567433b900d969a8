"""The planner against the paper's Table 1 (Narayanan et al., SC'21): prints Markdown.

For each of the ten GPT models (V=51200, s=2048, DGX A100 80GB, the a100-80gb preset):
the reported TFLOP/s per GPU; the model's prediction for the paper's own (tp, pp, dp) with
recomputation, microbatch size and interleaving left to the planner; and the planner's own
choice. `--sensitivity` adds how the error moves with the preset's one efficiency
constant (matmul_fraction), to show that nothing is tuned per row. `--fit` fits that
constant by least squares (planner/calibrate.py) to the ten rows and the paper's GPT-3 175B
figure and prints each run's predicted (the model's own, before the measured ceiling) and
measured TFLOP/s at the prior estimate (0.7) and at the fit, with the mean and largest
errors.

    python bench/planner_table1.py [--sensitivity] [--fit]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from threefold.planner.cluster import load_cluster
from threefold.planner.constraints import Constraints
from threefold.planner.gpt_cost import gpt_model_cost
from threefold.planner.paper_table1 import TABLE1
from threefold.planner.search import rank_plans


def evaluate_rows(cluster):
    rows = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, reported in TABLE1:
        model = gpt_model_cost(layers, hidden, heads)
        paper = rank_plans(model, batch, gpus, cluster, where=Constraints(tp=tp, pp=pp, recompute=True))[0]
        best = rank_plans(model, batch, gpus, cluster)[0]
        rows.append((params, tp, pp, gpus, batch, reported, paper, best))
    return rows


def _plan(e) -> str:
    c = e.config
    return (f"t={c.tp} p={c.pp} d={c.dp} b={c.microbatch_size}"
            + (f" v={c.interleave}" if c.interleave > 1 else "") + (" rc" if c.recompute else ""))


def markdown(rows, cluster) -> str:
    peak = cluster.peak("bf16")
    out = ["| Model | t, p, GPUs, batch | Reported TFLOP/s (% peak) | Predicted, paper's plan "
           "(b, v chosen) | Error | Planner's choice | Its TFLOP/s | Its speed-up | Its GiB/GPU |",
           "|---|---|---|---|---|---|---|---|---|"]
    for params, tp, pp, gpus, batch, reported, paper, best in rows:
        c = paper.config
        err = paper.tflops_per_gpu / reported - 1
        out.append(
            f"| {params}B | {tp}, {pp}, {gpus}, {batch} | {reported} ({reported * 1e12 / peak:.0%}) | "
            f"{paper.tflops_per_gpu:.1f} (b={c.microbatch_size}, v={c.interleave}) | {err:+.1%} | "
            f"{_plan(best)} | {best.tflops_per_gpu:.1f} | {paper.iteration_s / best.iteration_s:.2f}x | "
            f"{best.memory_bytes / 2**30:.1f} |")
    errors = [abs(r[6].tflops_per_gpu / r[5] - 1) for r in rows]
    out.append("")
    out.append(f"Largest error {max(errors):.1%}, mean absolute error {sum(errors) / len(errors):.1%} "
               f"(matmul_fraction = {cluster.matmul_fraction}).")
    return "\n".join(out)


def sensitivity(cluster) -> str:
    out = ["| matmul_fraction | errors per row (1.7B .. 1008B) | largest |", "|---|---|---|"]
    for fraction in (0.55, 0.6, 0.612, 0.65, 0.7):
        rows = evaluate_rows(dataclasses.replace(cluster, matmul_fraction=fraction))
        errs = [r[6].tflops_per_gpu / r[5] - 1 for r in rows]
        out.append(f"| {fraction} | {' '.join(f'{e:+.0%}' for e in errs)} | {max(map(abs, errs)):.1%} |")
    return "\n".join(out)


PRIOR_MATMUL_FRACTION = 0.7     # the a100-80gb preset's estimate before the fit


def fit_report(cluster) -> str:
    from threefold.planner.calibrate import fit_matmul_fraction, model_tflops, row_prediction
    from threefold.planner.paper_table1 import MEASURED_ROWS
    fitted = fit_matmul_fraction(MEASURED_ROWS, cluster)
    before = dataclasses.replace(cluster, matmul_fraction=PRIOR_MATMUL_FRACTION)
    after = dataclasses.replace(cluster, matmul_fraction=fitted)
    out = [f"Least-squares matmul_fraction: {fitted} (prior {PRIOR_MATMUL_FRACTION}; preset "
           f"{cluster.matmul_fraction})", "",
           f"| Run | t, p, GPUs, batch | Measured | Predicted at {PRIOR_MATMUL_FRACTION} | Error | "
           f"Predicted at {fitted} | Error | Plan at the fit |", "|---|---|---|---|---|---|---|---|"]
    errs = {PRIOR_MATMUL_FRACTION: [], fitted: []}
    for row in MEASURED_ROWS:
        cells = []
        for frac, c in ((PRIOR_MATMUL_FRACTION, before), (fitted, after)):
            e = row_prediction(row, c)
            tf = model_tflops(e)
            errs[frac].append(tf / row[-1] - 1)
            cells += [f"{tf:.1f}", f"{tf / row[-1] - 1:+.1%}"]
        out.append(f"| {row[0]}B{' (text)' if row[5] is None else ''} | {row[4]}, {row[5] or '-'}, {row[6]}, "
                   f"{row[7]} | {row[-1]} | " + " | ".join(cells) + f" | {_plan(e)} |")
    out.append("")
    for frac, e in errs.items():
        out.append(f"matmul_fraction {frac}: mean absolute error {sum(map(abs, e)) / len(e):.1%}, "
                   f"largest {max(map(abs, e)):.1%}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sensitivity", action="store_true", help="also sweep the matmul_fraction constant")
    parser.add_argument("--fit", action="store_true", help="fit matmul_fraction (least squares), rows before/after")
    args = parser.parse_args(argv)
    cluster = load_cluster("a100-80gb")
    print(markdown(evaluate_rows(cluster), cluster))
    if args.sensitivity:
        print()
        print(sensitivity(cluster))
    if args.fit:
        print()
        print(fit_report(cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
