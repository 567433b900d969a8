"""One HTML page: a header with the search box, the sections' HTML, and the page's data as
embedded JSON, with static/report.css and static/report.js inlined (no network, no CDN)."""
from __future__ import annotations

from html import escape
from importlib import resources


def _static(name: str) -> str:
    return resources.files("threefold.report").joinpath("static", name).read_text(encoding="utf-8")


def page(title: str, facts: str, sections: list[tuple[str, str, str]], data: dict,
         search: bool = True) -> str:
    """`sections`: (anchor, heading, inner HTML). `data` is what report.js reads."""
    nav = "".join(f'<a href="#{a}">{escape(h)}</a>' for a, h, _ in sections)
    box = ('<input id="search" type="search" placeholder="search parameters and ops (FQN, module, op)" '
           'autocomplete="off"><span id="search-count"></span>') if search else ""
    body = "\n".join(f'<section id="{a}"><h2>{escape(h)}</h2>\n{inner}\n</section>' for a, h, inner in sections)
    # JSON inside <script>: "</" would end the element, so it is written as "<\/"
    from threefold.cli.jsonout import dumps   # lazy: start-up: cli.jsonout loads only on this path
    payload = dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<style>
{_static("report.css")}</style></head>
<body>
<header><h1>{escape(title)}</h1><div class="facts">{facts}</div>
<nav>{box}{nav}</nav></header>
<main>
{body}
</main>
<script type="application/json" id="report-data">{payload}</script>
<script>
{_static("report.js")}</script>
</body></html>
"""


def table(headers: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,), attrs=None) -> str:
    """An HTML table; cells are HTML already (escape text first). `attrs`: per row, extra
    attributes for its <tr> (the search's data-search)."""
    head = "".join(f'<th class="l">{h}</th>' if i in left else f"<th>{h}</th>" for i, h in enumerate(headers))
    out = [f"<table><thead><tr>{head}</tr></thead><tbody>"]
    for k, row in enumerate(rows):
        extra = attrs[k] if attrs else ""
        cells = "".join(f'<td class="l">{c}</td>' if i in left else f"<td>{c}</td>" for i, c in enumerate(row))
        out.append(f"<tr{extra}>{cells}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def search_attr(kind: str, *words) -> str:
    text = " ".join(str(w) for w in words).lower()
    return f' data-kind="{kind}" data-search="{escape(text, quote=True)}"'
