"""Measuring tools of bench/tp_vs_dtensor.py: user-code line counts, collective accounting
(a dispatch mode that counts c10d and functional collectives at run time; the collectives a
compiled threefold program holds, per transformer layer) and per-rank profiles (torch.profiler
op table, cProfile), each synchronised with a barrier so both ranks profile the same steps.
"""
from __future__ import annotations

import ast
import dataclasses
import cProfile
import inspect
import io
import pstats
import textwrap

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def code_lines(fn) -> int:
    """Body lines of fn that hold code: no def line, docstring, comment-only or blank lines."""
    src = textwrap.dedent(inspect.getsource(fn))
    body = ast.parse(src).body[0].body
    skip = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    first = body[0].lineno
    lines = src.splitlines()
    return sum(1 for i, line in enumerate(lines, 1)
               if i >= first and i not in skip and line.strip() and not line.strip().startswith("#"))


# ---- collective accounting ---------------------------------------------------------------

class CollectiveCounter(TorchDispatchMode):
    """Every c10d (threefold: dist.all_reduce) or functional (DTensor) collective, with sizes."""

    KINDS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce",
             "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
             "broadcast_": "broadcast", "all_to_all_single": "all_to_all"}

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = self.KINDS.get(func.__name__.split(".")[0])
            if kind:
                t = args[0]
                n = sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()
                self.calls.append((kind, int(n)))
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        for kind, n in self.calls:
            d = out.setdefault(kind, {"calls": 0, "elements": 0, "sizes": {}})
            d["calls"] += 1
            d["elements"] += n
            d["sizes"][str(n)] = d["sizes"].get(str(n), 0) + 1
        return out


def graph_collectives(prog) -> list[dict]:
    """The collectives threefold's compiled chunk graphs hold, with the module they serve."""
    out = []
    for chunk in prog.chunks:
        for node in chunk.gm.graph.nodes:
            t = node.meta.get("tf", {})
            c = t.get("collective")
            if c:
                fields = dataclasses.asdict(c) if dataclasses.is_dataclass(c) else dict(c)
                out.append({"node": node.name, "module": t.get("module", ""), **fields})
    return out


def per_layer_volume(colls: list[dict], n_layer: int, t: int) -> list[dict]:
    rows = []
    for i in range(n_layer):
        mine = [c for c in colls if c["module"].startswith(f"h.{i}.") and c["kind"] == "all_reduce"]
        fwd = sum(c["elements"] * c.get("count", 1) for c in mine if c["phase"] == "forward")
        bwd = sum(c["elements"] * c.get("count", 1) for c in mine if c["phase"] == "backward")
        rows.append({"layer": i, "all_reduces": sum(c.get("count", 1) for c in mine),
                     "forward_elements": fwd, "backward_elements": bwd,
                     "ring_elements_per_rank": 2 * (fwd + bwd) * (t - 1) / t,
                     "other_collectives": [c["kind"] for c in colls
                                           if c["module"].startswith(f"h.{i}.") and c["kind"] != "all_reduce"]})
    return rows


def op_profile(fn, iters: int = 5, sync: bool = True) -> dict:
    """torch.profiler self CPU time per op (ms per step, calls per step); for collectives and
    the f/g functions that is mostly time spent waiting for the peer."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    if sync:
        dist.barrier()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            if sync:
                dist.barrier()
            fn()
    return {e.key: (e.self_cpu_time_total / iters / 1e3, e.count // iters) for e in prof.key_averages()
            if e.key not in ("gloo:barrier", "c10d::barrier")}


def op_table(ops: dict, top: int = 16) -> str:
    sides = list(ops)
    keys = sorted(set().union(*ops.values()), key=lambda k: -max(ops[s].get(k, (0, 0))[0] for s in sides))
    lines = [f"{'op (self CPU ms per step, calls)':<42} " + " ".join(f"{s:>16}" for s in sides),
             f"{'total':<42} " + " ".join(f"{sum(v[0] for v in ops[s].values()):>16.1f}" for s in sides)]
    for k in keys[:top]:
        lines.append(f"{k[:42]:<42} " + " ".join(
            f"{ops[s].get(k, (0, 0))[0]:>10.1f} {ops[s].get(k, (0, 0))[1]:>5}" for s in sides))
    return "\n".join(lines)


def profile(fn, iters: int = 5, top: int = 22) -> str:
    """cProfile of `iters` steps on this rank: the functions with the most own time."""
    prof = cProfile.Profile()
    for _ in range(iters):
        dist.barrier()
        prof.enable()
        fn()
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    return text[text.find("   ncalls"):] if "   ncalls" in text else text
