"""What a finished run leaves: the summary (printed, or --json) and the files in --out.

--out holds losses.json (plan, losses, seconds, validation losses by step), metrics.jsonl
(one row per step: loss, val_loss when measured, lr, grad_norm, tokens/s, model FLOP/s,
memory per rank), the pictures (loss.png with validation, lr.png, tokens_per_second.png),
sample.txt for a language model, and tensorboard/ when TensorBoard was available; with
--trace, trace.json (the merged per-rank timeline, runtime/trace_merge.py) and trace.html
(it drawn, with the measured and simulated bubble: threefold/report/).
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
        "seconds": sum(seconds), "out": out, "skipped_steps": skipped_steps(result),
        "sample": result.get("sample"), "plot": os.path.join(out, "loss.png"),
        "trace": trace_summary(result.get("trace"), out),
        "restarts": result.get("restarts") or [],
    }


def trace_summary(trace: dict | None, out: str) -> dict | None:
    """The summary's view of a --trace run: where the files are, the measured bubble and idle
    per rank next to the simulator's (runtime/trace_stats.py), and what tracing cost."""
    if not trace:
        return None
    # lazy: start-up: runtime.trace_stats loads only on this path
    from threefold.runtime.trace_stats import summarize as trace_stats
    stats = trace_stats(trace)
    if stats["measured"] is None:
        return {"file": os.path.join(out, "trace.json"), "steps": []}
    tracer = stats["tracer"]["per_rank"]
    return {"file": os.path.join(out, "trace.json"), "html": os.path.join(out, "trace.html"),
            "steps": trace["otherData"]["steps"],
            "measured_bubble_fraction": stats["measured"]["bubble_fraction"],
            "simulated_bubble_fraction": stats["simulated"]["bubble_fraction"],
            "window_s": stats["measured"]["window_s"], "simulated_makespan_s": stats["simulated"]["makespan_s"],
            "idle_s_per_rank": stats["measured"]["idle_s"],
            "simulated_idle_s_per_stage": stats["simulated"]["idle_s"],
            "tracing_ns_per_step": max(r["estimated_ns_per_step"] for r in tracer),
            "tracing_share_of_step": stats["tracer"]["worst_share_of_step"]}


def _peak_rss(rows: list[dict]) -> list[float]:
    peaks: list[float] = []
    for r in rows:
        for i, m in enumerate(r.get("memory", [])):
            if i >= len(peaks):
                peaks.append(m["rss_mb"])
            peaks[i] = max(peaks[i], m["rss_mb"])
    return peaks


def write_losses(tmp: str, result: dict, plan) -> None:
    """losses.json: the plan, the loss and time of every step, validation losses by step, and
    the steps whose update was skipped (--skip-nonfinite, fp16 overflow) with the reason."""
    with open(os.path.join(tmp, "losses.json"), "w") as f:
        f.write(dumps({"plan": str(plan), "losses": result["losses"], "seconds": result["seconds"],
                       "val_losses": val_points(result), "skipped_steps": skipped_steps(result),
                       "restarts": result.get("restarts") or []}))


def skipped_steps(result: dict) -> list[dict]:
    """[{"step": n, "reason": ...}] for every step that ran without updating the weights."""
    out = []
    for s in result.get("skipped", []):
        out.append(s if isinstance(s, dict) else {"step": int(s), "reason": "non-finite (--skip-nonfinite)"})
    return out


def write_run(tmp: str, result: dict, plan, live: str | None) -> None:
    """Fill the --out directory being built at `tmp`."""
    from threefold.train.plots import plot_run   # lazy: start-up: train.plots loads only on this path
    rows = result["rows"]
    write_losses(tmp, result, plan)
    with open(os.path.join(tmp, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(dumps(r) + "\n")   # valid JSON: a non-finite value is null
    if rows:
        plot_run(rows, str(plan), tmp, val_points(result))
    if result.get("sample") is not None:
        with open(os.path.join(tmp, "sample.txt"), "w", encoding="utf-8") as f:
            f.write(result["sample"])
    if result.get("trace"):
        # lazy: start-up: report.trace_page loads only on this path
        from threefold.report.trace_page import trace_html
        with open(os.path.join(tmp, "trace.json"), "w") as f:
            f.write(dumps(result["trace"]))
        with open(os.path.join(tmp, "trace.html"), "w", encoding="utf-8") as f:
            f.write(trace_html(result["trace"]))
    events = os.path.join(live, "tensorboard") if live else None
    if events and os.path.isdir(events):
        shutil.copytree(events, os.path.join(tmp, "tensorboard"))
