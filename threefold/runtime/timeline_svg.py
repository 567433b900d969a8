"""Draw a simulated schedule as an SVG timeline: one row per pipeline rank, one box per
forward (blue) or backward (green; in zero-bubble schedules B, the input gradients, with W,
the weight gradients, in orange) labelled with its microbatch id. With v > 1 the shade
says which of the rank's chunks ran (darker = later in the model); hovering a box shows the
full action. Hand-written SVG, no plotting library."""
from __future__ import annotations

import math
from html import escape

from threefold.runtime.schedule import Kind
from threefold.runtime.simulate import Simulation

_FWD = ["#4c78a8", "#2f5f8f", "#1c4670", "#0e2f52"]    # forward shades by local chunk index
_BWD = ["#59a14f", "#3f8436", "#2a6623", "#184a14"]    # backward shades
_WGT = ["#f28e2b", "#c46f1c", "#99530f", "#6e3a05"]    # weight-gradient (W) shades
ROW, GAP, LEFT, TOP, RIGHT = 28, 6, 70, 46, 20
FONT, TITLE_FONT = 11, 13        # px, monospace


def text_width(text: str, font_px: float = FONT) -> float:
    """An upper bound of `text`'s width in a monospace font (advance 0.6 em in DejaVu Sans
    Mono, Liberation Mono, Menlo, Consolas; 0.62 em here for margin)."""
    return 0.62 * font_px * len(text)


def render_svg(sim: Simulation, width: int = 1000, title: str | None = None) -> str:
    """The timeline; `title` replaces the default heading (the planner names its plan there).
    The picture is `width` wide, or wider when the title or the legend needs it."""
    s = sim.schedule
    span = sim.makespan or 1
    title = title or (f"{s.name}  pp={s.pp}  m={s.m}  v={s.v}   makespan {_num(sim.makespan)}   "
                      f"bubble {sim.bubble_fraction:.1%} of rank-time (idle/busy {sim.bubble_ratio:.3f})")
    legend, legend_end = _legend(LEFT, 34, s.v, s.splits_backward)
    width = math.ceil(max(width, legend_end + RIGHT, LEFT + text_width(title, TITLE_FONT) + RIGHT))
    scale = (width - LEFT - RIGHT) / span
    height = TOP + s.pp * (ROW + GAP) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="{FONT}">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{LEFT}" y="18" font-size="{TITLE_FONT}">{escape(title)}</text>',
           legend]
    for r, acts in enumerate(s.actions):
        y = TOP + r * (ROW + GAP)
        out.append(f'<text x="{LEFT - 8}" y="{y + ROW / 2 + 4}" text-anchor="end">rank {r}</text>')
        out.append(f'<rect x="{LEFT}" y="{y}" width="{span * scale:.2f}" height="{ROW}" fill="#f2f2f2"/>')
        for a, t0, t1 in zip(acts, sim.start[r], sim.end[r]):
            if not a.is_compute:
                continue
            shades = _FWD if a.kind is Kind.FORWARD else _WGT if a.kind is Kind.WEIGHT else _BWD
            shade = shades[min(a.chunk // s.pp, 3)]
            x, w = LEFT + t0 * scale, max((t1 - t0) * scale, 0.5)
            out.append(f'<g><title>{a} on rank {r}: {_num(t0)} to {_num(t1)}</title>'
                       f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" fill="{shade}" '
                       f'stroke="white" stroke-width="0.5"/>')
            if w >= 12:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + ROW / 2 + 4}" text-anchor="middle" '
                           f'fill="white">{a.mb}</text>')
            out.append('</g>')
    axis_y = TOP + s.pp * (ROW + GAP) + 4
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{LEFT + span * scale:.2f}" y2="{axis_y}" stroke="black"/>')
    step = _tick_step(span)
    for i in range(int(span / step + 1e-9) + 1):
        t = i * step
        x = LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="black"/>'
                   f'<text x="{x:.2f}" y="{axis_y + 16}" text-anchor="middle">{_num(t)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend(x: float, y: int, v: int, split: bool = False) -> tuple[str, float]:
    """The legend's SVG, starting at x, and where it ends (the picture must reach that far)."""
    parts = []
    kinds = ((("forward", _FWD), ("B: input grads", _BWD), ("W: weight grads", _WGT)) if split
             else (("forward", _FWD), ("backward", _BWD)))
    for label, shades in kinds:
        for k in range(min(v, 4)):
            parts.append(f'<rect x="{x}" y="{y - 9}" width="12" height="10" fill="{shades[k]}"/>')
            x += 14
        text = label if v == 1 else f"{label} (chunk 1..{v} of the rank)"
        parts.append(f'<text x="{x + 2:.1f}" y="{y}">{text}</text>')
        x += 2 + text_width(text) + 12
    last = "label = microbatch"
    parts.append(f'<text x="{x:.1f}" y="{y}">{last}</text>')
    return "".join(parts), x + text_width(last)


def _tick_step(span: float) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving at most 20 ticks."""
    exp = math.floor(math.log10(span / 20)) if span > 0 else 0
    for base in (1, 2, 5, 10):
        step = base * 10.0 ** exp
        if span / step <= 20:
            return step
    return span / 10


def _num(t: float) -> str:
    return f"{t:.6g}"
