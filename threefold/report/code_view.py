"""A generated chunk module as HTML lines, each with the source module it came from.

codegen/python.py ends every generated op line with `# module  placement  local shape`
(two spaces apart); a call wrapped over several lines carries it on its first line. Those
lines are the page's "ops": the search matches their text (value names, aten op, module,
placement); other lines (header, PARAMS, imports) are shown as they are.
"""
from __future__ import annotations

import re
from html import escape

from threefold.report.page import search_attr

_OP = re.compile(r"^(?P<code>\s+\S.*?)  # (?P<note>\S.*)$")


def split_line(line: str) -> tuple[str, str | None]:
    """(code, module) of a generated op line, (line, None) for any other line."""
    match = _OP.match(line)
    if not match or "=" not in match.group("code"):
        return line, None
    module = match.group("note").split("  ")[0]
    return match.group("code"), module


def chunk_code(text: str) -> str:
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        code, module = split_line(line)
        if module is None:
            out.append(f'<div class="line"><span class="ln">{n}</span><span>{escape(line)}</span>'
                       '<span class="src"></span></div>')
            continue
        rest = line[len(code):].strip()[2:].strip()[len(module):].strip()   # placement, shape
        out.append(f'<div class="line op"{search_attr("op", line)}><span class="ln">{n}</span>'
                   f'<span>{escape(code)}</span>'
                   f'<span class="src" title="{escape(rest, quote=True)}"><b>{escape(module)}</b> {escape(rest)}</span></div>')
    return "".join(out)
