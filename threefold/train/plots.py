"""End-of-run pictures: loss and validation loss, learning rate, tokens/s (one PNG each).

matplotlib is a dependency of threefold (pyproject); the Agg backend draws without a display.
"""
from __future__ import annotations

import math
import os

BLUE, ORANGE, GREEN = "#2463eb", "#e8730c", "#16a34a"


def _axes(title: str, ylabel: str):
    import matplotlib   # lazy: matplotlib loads only to draw a plot
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # lazy: matplotlib loads only to draw a plot
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return os.path.abspath(path)


def plot_run(rows: list[dict], plan: str, out_dir: str, val: list | None = None) -> dict[str, str]:
    """Draw loss.png, lr.png and tokens_per_second.png from the per-step log rows (and the
    validation points (step, loss), by default the rows' own)."""
    steps = [r["step"] for r in rows]
    paths = {}
    plt, fig, ax = _axes(f"threefold train  ({plan})", "loss")
    ax.plot(steps, [r["loss"] for r in rows], color=BLUE, linewidth=1.2, label="train")
    if val is None:
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    val = [(s, v) for s, v in val if v is not None and math.isfinite(v)]
    if val:
        ax.plot(*zip(*val), color=ORANGE, linewidth=1.6, marker="o", markersize=3, label="validation")
        ax.legend()
    paths["loss"] = _save(plt, fig, os.path.join(out_dir, "loss.png"))
    plt, fig, ax = _axes("learning rate", "lr")
    ax.plot(steps, [r["lr"] for r in rows], color=GREEN, linewidth=1.4)
    paths["lr"] = _save(plt, fig, os.path.join(out_dir, "lr.png"))
    plt, fig, ax = _axes("throughput", "tokens/s")
    ax.plot(steps, [r["tokens_per_s"] for r in rows], color=BLUE, linewidth=1.0, alpha=0.5, label="step")
    ax.plot(steps, [r["tokens_per_s_avg"] for r in rows], color=ORANGE, linewidth=1.6, label="running (as reported)")
    ax.legend()
    paths["tokens_per_second"] = _save(plt, fig, os.path.join(out_dir, "tokens_per_second.png"))
    return paths
