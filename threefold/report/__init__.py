"""Self-contained HTML reports: `threefold inspect --html` (threefold/report/inspect_page.py)
and the trace page `threefold train --trace` writes (threefold/report/trace_page.py). Pages
read what `inspect --json`, `inspect --memory --json` and the trace file hold; the CSS and
JavaScript in static/ are inlined, so a page needs no network."""
