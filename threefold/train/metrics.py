"""What the loop measures each step, and where it goes: a JSON-lines log and TensorBoard.

  * tokens/s: one formula for the progress bar, the log and the summary (`tokens_per_second`:
    the steps after the first, which pays for warm-up, or the first when it is all);
  * model FLOP/s: the compiler's cost model (passes/cost.py) over the compiled graph,
    each op counted once for the whole model (an op on tensor-parallel shards or partial
    sums counts its local FLOPs times tp, a replicated one once), forward plus a backward
    of twice the forward (the usual "model FLOPs": recomputation is not useful work);
  * memory: every rank's resident set size (and peak CUDA allocation on a GPU), gathered.
TensorBoard is used when it is installed (torch.utils.tensorboard needs the `tensorboard`
package); without it the JSON-lines log is the record, and nothing fails.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist


def tokens_per_second(seconds: list[float], tokens_per_step: int) -> float:
    steady = seconds[1:] or seconds
    total = sum(steady)
    return tokens_per_step * len(steady) / total if total > 0 else 0.0


def model_flops_per_step(pm) -> float:
    """Forward plus backward FLOPs of one optimizer step over the global batch, as the
    compiler's cost model counted them (the manifest's `model_flops`; nan if unknown)."""
    flops = pm.manifest.model_flops
    return float(flops) if flops else math.nan


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource   # lazy: POSIX-only module, read only here
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # peak, the best we have


def memory_per_rank(device: torch.device | None = None) -> list[dict]:
    """[{"rss_mb": ..., ("cuda_peak_mb": ...)}] for every rank (collective: all ranks call it)."""
    cuda = device is not None and device.type == "cuda"
    mine = [_rss_bytes(), torch.cuda.max_memory_allocated(device) if cuda else -1]
    t = torch.tensor(mine, dtype=torch.int64, device=device if cuda else "cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
    else:
        parts = [t]
    out = []
    for p in parts:
        rss, peak = (int(v) for v in p.tolist())
        entry = {"rss_mb": round(rss / 2**20, 1)}
        if peak >= 0:
            entry["cuda_peak_mb"] = round(peak / 2**20, 1)
        out.append(entry)
    return out


class MetricsLog:
    """Rank 0's per-step record: appended to `path` (JSON lines, flushed each step, so a
    crashed run keeps its log) and mirrored to TensorBoard under `tb_dir` when available."""

    def __init__(self, path: str | None, tb_dir: str | None = None):
        self.rows: list[dict] = []
        self.file = open(path, "a", encoding="utf-8") if path else None
        self.tb = None
        if tb_dir:
            try:
                # lazy: tensorboard loads only when a run logs to it
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(tb_dir)
            except Exception:   # tensorboard not installed: the JSON log is the record
                self.tb = None

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.file:
            from threefold.cli.jsonout import dumps   # lazy: start-up: cli.jsonout loads only on this path
            self.file.write(dumps(row) + "\n")   # valid JSON: a non-finite value is null
            self.file.flush()
        if self.tb is not None:
            step = row["step"]
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(f"train/{key}", value, step)
            for r, mem in enumerate(row.get("memory", [])):
                self.tb.add_scalar(f"memory/rank{r}_rss_mb", mem["rss_mb"], step)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
