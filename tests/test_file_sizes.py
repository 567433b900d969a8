"""Small files with one job each: no module of the package over 600 lines (DESIGN.md's
style rule; a file that grows past it splits a job out, as runtime/grad_reduce.py left
runtime/engine.py)."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 600


def test_no_module_over_the_limit():
    over = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "threefold")):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                n = sum(1 for _ in f)
            if n > LIMIT:
                over.append(f"{rel} ({n} lines)")
    assert over == [], f"modules over {LIMIT} lines (split a job out): {over}"
