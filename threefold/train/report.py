"""What a finished run leaves: the summary (printed, or --json) and the files in --out.

--out holds losses.json (plan, losses, seconds, validation losses by step), metrics.jsonl
(one row per step: loss, val_loss when measured, lr, grad_norm, tokens/s, model FLOP/s,
memory per rank), the pictures (loss.png with validation, lr.png, tokens_per_second.png),
sample.txt for a language model, and tensorboard/ when TensorBoard was available.
"""
from __future__ import annotations

import os
import shutil

from threefold.cli.jsonout import dumps
from threefold.train.metrics import tokens_per_second


def val_points(result: dict) -> list[tuple[int, float]]:
    """(step, validation loss): before training (step 0), then every measured step."""
    start = result.get("initial_val_loss")
    return ([(0, start)] if start is not None else []) + \
        [(r["step"], r["val_loss"]) for r in result["rows"] if r.get("val_loss") is not None]


def summarize(result: dict, plan, out: str) -> dict:
    losses, seconds, rows = result["losses"], result["seconds"], result["rows"]
    steady = seconds[1:] or seconds
    val = val_points(result)
    return {
        "plan": str(plan), "steps": len(losses), "first_loss": losses[0], "final_loss": losses[-1],
        "first_val_loss": val[0][1] if val else None, "final_val_loss": val[-1][1] if val else None,
        "val_losses": val,
        "tokens_per_second": tokens_per_second(seconds, result["tokens_per_step"]),
        "model_flops_per_step": result["flops_per_step"],
        "model_flops_per_second": result["flops_per_step"] * len(steady) / sum(steady) if sum(steady) else 0.0,
        "final_grad_norm": rows[-1]["grad_norm"] if rows else None,
        "peak_rss_mb_per_rank": _peak_rss(rows),
        "seconds": sum(seconds), "out": out, "skipped_steps": result["skipped"],
        "sample": result.get("sample"), "plot": os.path.join(out, "loss.png"),
    }


def _peak_rss(rows: list[dict]) -> list[float]:
    peaks: list[float] = []
    for r in rows:
        for i, m in enumerate(r.get("memory", [])):
            if i >= len(peaks):
                peaks.append(m["rss_mb"])
            peaks[i] = max(peaks[i], m["rss_mb"])
    return peaks


def write_run(tmp: str, result: dict, plan, live: str | None) -> None:
    """Fill the --out directory being built at `tmp`."""
    from threefold.train.plots import plot_run
    rows = result["rows"]
    with open(os.path.join(tmp, "losses.json"), "w") as f:
        f.write(dumps({"plan": str(plan), "losses": result["losses"], "seconds": result["seconds"],
                       "val_losses": val_points(result)}))
    with open(os.path.join(tmp, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(dumps(r) + "\n")   # valid JSON: a non-finite value is null
    if rows:
        plot_run(rows, str(plan), tmp, val_points(result))
    if result.get("sample") is not None:
        with open(os.path.join(tmp, "sample.txt"), "w", encoding="utf-8") as f:
            f.write(result["sample"])
    events = os.path.join(live, "tensorboard") if live else None
    if events and os.path.isdir(events):
        shutil.copytree(events, os.path.join(tmp, "tensorboard"))
