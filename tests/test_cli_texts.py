"""What the commands print and draw says what is true: the plan table tells plans apart by
schedule, `why` names the best plan's own settings, the schedule SVG holds its whole
legend, and the help texts point at files that exist and describe the artifact as it is."""
from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET

import pytest

from threefold.cli.main import build_parser, main
from threefold.runtime.schedule import make_schedule
from threefold.runtime.simulate import verify
from threefold.runtime.timeline_svg import render_svg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "1024", "--batch", "32", "--gpus", "16"]


def test_plan_rows_name_their_schedule_and_why_matches_the_best_plan(capsys):
    assert main(["plan", *SMALL, "--top", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("#"))
    assert "schedule" in out[head]
    rows = [re.split(r"\s{2,}", line) for line in out[head + 1:] if re.match(r"\d+\s", line)]
    cells = [(r[1], r[2]) for r in rows]
    assert len(set(cells)) == len(cells)                        # no two rows read the same
    assert len({r[1] for r in rows}) < len(rows)                # ... which the plan cell alone did
    best = next(line for line in out if line.startswith("best: "))
    plan = dict(item.split("=") for item in best.split()[1].split(","))
    why = {m.group(1): m.group(2) for m in (re.match(r"  (\w+)=(\S+): ", line) for line in out) if m}
    assert why["recompute"] == plan.get("recompute", "none")   # was "recompute=false" next to selective
    assert why["schedule"] == plan["schedule"] and why["v"] == plan["v"]


def _extent(text: ET.Element, default_px: float) -> tuple[float, float]:
    """(left, right) of a text element, 0.6 em per character (monospace)."""
    size = float(text.get("font-size", default_px))
    width = 0.6 * size * len(text.text or "")
    x = float(text.get("x"))
    anchor = text.get("text-anchor", "start")
    return {"start": (x, x + width), "middle": (x - width / 2, x + width / 2), "end": (x - width, x)}[anchor]


@pytest.mark.parametrize("kind,pp,m,v", [("1f1b", 2, 4, 1), ("interleaved", 4, 8, 4), ("zbv", 2, 4, 2),
                                         ("zb-h1", 8, 16, 1), ("1f1b", 1, 1, 1)])
def test_every_svg_text_lies_inside_the_picture(kind, pp, m, v):
    root = ET.fromstring(render_svg(verify(make_schedule(kind, pp, m, v)).simulation))
    width = float(root.get("width"))
    texts = [e for e in root.iter() if e.tag.endswith("text")]
    assert any("label = microbatch" == (t.text or "") for t in texts)       # the legend's last entry
    for t in texts:
        left, right = _extent(t, float(root.get("font-size")))
        assert left >= 0 and right <= width, (t.text, right, width)


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[command].format_help()


def test_help_texts_point_at_files_that_exist_and_say_one_module_per_chunk():
    text = " ".join(_help("check").split())
    assert "DESIGN.md" not in text and "docs/design.md" in text
    assert os.path.isfile(os.path.join(ROOT, "docs", "design.md"))
    compile_help = " ".join(_help("compile").split())
    assert "module per (pipeline chunk, tp rank)" not in compile_help
    assert "one Python module per pipeline chunk" in compile_help
    for command in ("train", "check", "compile", "inspect"):
        assert "2*pp" in " ".join(_help(command).split()), command   # the m default is stated
