"""The code blocks of README.md and docs/, and how tests/test_docs.py runs them.

A page runs its blocks in order in one fresh directory (with `examples/` linked in), so a
block may use a file an earlier one wrote. What a block is, is said by a comment on the line
just above it:

    (none)                       ```python: written to a file and run with python;
                                 ```bash: run with bash -euo pipefail (`threefold`, `python`
                                 are this interpreter)
    <!-- run: file NAME -->      written to NAME for later blocks, not run itself
    <!-- run: skip REASON -->    not runnable here (installs packages, needs a cluster)

A page's tier is a comment anywhere on it: `<!-- docs-test: slow -->` for a page whose
blocks spawn ranks or take long (marked `slow`; outside tests/tiers.py's sample that means
`extended`), `<!-- docs-test: quick -->` (the default) for one that does neither.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNABLE = ("python", "bash")
_FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*run:\s*(file|skip)\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: str           # path relative to the repository root
    index: int          # position on the page
    lang: str
    code: str
    action: str         # "run", "file" or "skip"
    arg: str = ""       # the file name, or why it is skipped


def pages() -> list[str]:
    out = ["README.md"]
    for dirpath, _, names in os.walk(os.path.join(ROOT, "docs")):
        out += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in sorted(names) if n.endswith(".md")]
    return sorted(out)


def blocks(page: str) -> list[Block]:
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    out = []
    for i, m in enumerate(_FENCE.finditer(text)):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        d = _DIRECTIVE.search(before)
        action, arg = (d.group(1), d.group(2)) if d else ("run", "")
        out.append(Block(page, i, m.group(1) or "text", m.group(2), action, arg))
    return out


def tier(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        m = re.search(r"<!--\s*docs-test:\s*(\w+)\s*-->", f.read())
    return m.group(1) if m else "quick"


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]
