"""Draw a plan's pipeline timeline as a hand-written SVG (no plotting dependency).

One row per pipeline stage, one rectangle per forward or backward of a (chunk,
microbatch), placed by simulating Megatron's order (1F1B, or interleaved when v > 1) with
the per-stage times the performance model predicts and the boundary transfer between
stages. The order is the same as `runtime/schedule.py` builds; it is rebuilt here so the
planner stays independent of the runtime.
"""
from __future__ import annotations

from html import escape

from threefold.compiler.perf_model import Estimate

Step = tuple[bool, int, int]   # (is_backward, chunk, microbatch)


def stage_order(stage: int, pp: int, m: int, v: int) -> list[Step]:
    """Megatron's order for one stage: warm-up forwards, one-forward-one-backward, drain.

    Chunk c lives on stage c % pp. Microbatches go in groups of pp; within a group every
    local chunk in turn (model order forward, reverse order backward)."""
    def table(backward: bool) -> list[tuple[int, int]]:
        out = []
        for first in range(0, m, pp):
            group = range(first, min(first + pp, m))
            for k in range(v):
                local = v - 1 - k if backward else k
                out.extend((local * pp + stage, i) for i in group)
        return out
    fwd, bwd = table(False), table(True)
    warmup = pp - stage - 1 if v == 1 else (pp - stage - 1) * 2 + (v - 1) * pp
    warmup = min(warmup, len(fwd))
    order: list[Step] = [(False, c, i) for c, i in fwd[:warmup]]
    for k in range(len(fwd) - warmup):
        order.append((False, *fwd[warmup + k]))
        order.append((True, *bwd[k]))
    order.extend((True, c, i) for c, i in bwd[len(fwd) - warmup:])
    return order


def simulate(pp: int, m: int, v: int, times: list[tuple[float, float]], transfer: float = 0.0
             ) -> dict[Step, tuple[int, float, float]]:
    """Start and end of every step: each stage runs its order as early as its inputs allow.

    times[stage] = (forward, backward) seconds of one chunk on that stage. Returns
    step -> (stage, start, end)."""
    last = pp * v - 1
    orders = [stage_order(r, pp, m, v) for r in range(pp)]
    done: dict[Step, tuple[int, float, float]] = {}
    clock, pos = [0.0] * pp, [0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                is_b, c, i = step = orders[r][pos[r]]
                if is_b:
                    deps = [(False, c, i)] + ([] if c == last else [(True, c + 1, i)])
                else:
                    deps = [(False, c - 1, i)] if c > 0 else []
                if any(d not in done for d in deps):
                    break
                ready = max([clock[r]] + [done[d][2] + (transfer if done[d][0] != r else 0.0) for d in deps])
                end = ready + times[r][1 if is_b else 0]
                done[step] = (r, ready, end)
                clock[r], pos[r], moved = end, pos[r] + 1, True
    if any(pos[r] < len(orders[r]) for r in range(pp)):  # pragma: no cover - the order never deadlocks
        raise RuntimeError(f"pipeline order pp={pp} m={m} v={v} deadlocked")
    return done


def timeline_svg(est: Estimate, max_steps: int = 4000) -> str:
    """SVG of the estimate's pipeline (microbatches capped so the drawing stays small)."""
    c = est.config
    pp, v, m = c.pp, c.interleave, c.microbatches
    shown = m
    if 2 * pp * v * m > max_steps:   # keep the shape: a multiple of pp microbatches, at least 2 groups
        shown = max(2 * pp, (max_steps // (2 * pp * v)) // pp * pp)
        shown = min(shown, m)
    steps = simulate(pp, shown, v, est.stage_times, est.transfer_s)
    span = max(end for _, _, end in steps.values()) or 1.0
    width, row, left, top = 1200, 22, 70, 46
    height = top + pp * row + 40
    scale = (width - left - 10) / span
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    title = (f"tp={c.tp} pp={pp} dp={c.dp} b={c.microbatch_size} v={v} m={m} recompute={str(c.recompute).lower()}"
             f"  predicted {est.tflops_per_gpu:.0f} TFLOP/s/GPU, bubble {est.bubble_fraction:.1%}")
    if shown < m:
        title += f"  (first {shown} of {m} microbatches shown)"
    out.append(f'<text x="{left}" y="16" font-size="13">{escape(title)}</text>')
    out.append(f'<text x="{left}" y="34" fill="#555">forward (blue, darker = later chunk), '
               f'backward (orange), time 0 .. {span * 1e3:.1f} ms</text>')
    for r in range(pp):
        y = top + r * row
        out.append(f'<text x="4" y="{y + 15}">stage {r}</text>')
    for (is_b, chunk, mb), (r, start, end) in sorted(steps.items(), key=lambda kv: kv[1][1]):
        local = chunk // pp
        shade = 0.35 + 0.5 * (local / max(1, v - 1)) if v > 1 else 0.6
        color = _rgb(0.95, 0.55 * (1.6 - shade), 0.15) if is_b else _rgb(0.2 * (1.4 - shade), 0.45 * (1.5 - shade), 0.9)
        x, w = left + start * scale, max(0.5, (end - start) * scale)
        y = top + r * row
        out.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" fill="{color}" '
                   f'stroke="white" stroke-width="0.5"><title>{"B" if is_b else "F"}{chunk}.{mb} '
                   f'{start * 1e3:.2f}-{end * 1e3:.2f} ms</title></rect>')
        if w > 14:
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + 15}" text-anchor="middle" fill="white">{mb}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _rgb(r: float, g: float, b: float) -> str:
    clamp = lambda x: max(0, min(255, int(x * 255)))  # noqa: E731
    return f"#{clamp(r):02x}{clamp(g):02x}{clamp(b):02x}"
