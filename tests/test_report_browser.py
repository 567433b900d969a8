"""The HTML reports in a real browser: headless Chromium (Debian's package, driven by
playwright; `.ci/run` installs both) opens `inspect --html` and the trace page, finds no
console errors, and checks that the search filters parameters and ops and that the measured
timeline draws one box per traced event. Skipped only where no Chromium is installed."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.parity import ROOT
from tests.trace_helpers import synthetic_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[test]')")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SPEC = "examples/gpt.py:workload(n_layer=2,n_embd=16,n_head=2,vocab_size=32,seq=8,batch=4)"
PLAN = "tp=2,pp=2,m=2"


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="threefold-chromium-")
    with playwright.sync_playwright() as p:
        # a persistent context is the way to hand Chromium a fresh, empty --user-data-dir
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                   viewport={"width": 1400, "height": 900})
        yield ctx
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


def _open(browser, path: str):
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: problems.append(f"network: {r.url}") if not r.url.startswith(("file:", "data:", "about:")) else None)
    page.goto("file://" + path)
    page.wait_for_load_state("load")
    return page, problems


@pytest.fixture(scope="module")
def inspect_page(tmp_path_factory):
    """inspect --html for a tp=2,pp=2 GPT with a (simulated) trace of the same plan; and the
    inspect --json of the same plan, to check the page against."""
    import json
    from threefold.cli.main import main
    d = tmp_path_factory.mktemp("report")
    trace, _ = synthetic_trace("1f1b", 2, 2, steps=(3, 4), plan="tp=2,pp=2,dp=1,m=2,v=1,schedule=1f1b")
    with open(d / "trace.json", "w") as f:
        json.dump(trace, f)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["inspect", SPEC, "--plan", PLAN, "--html", str(d / "report.html"),
                     "--trace", str(d / "trace.json")]) == 0
    finally:
        os.chdir(cwd)
    from threefold.cli.inspect_cmd import chunk_report
    from threefold.compiler.api import compile_workload
    from threefold.workload import load_spec
    os.chdir(ROOT)
    try:
        report = chunk_report(compile_workload(load_spec(SPEC), PLAN))
    finally:
        os.chdir(cwd)
    return str(d / "report.html"), report, trace


def test_inspect_report_opens_without_errors_and_searches(browser, inspect_page):
    path, report, trace = inspect_page
    page, problems = _open(browser, path)
    rows = page.locator("tr[data-kind=param]")
    assert rows.count() == len(report["parameters"]) > 0
    ops = page.locator(".line.op").count()
    assert ops > 50
    # search: parameters and ops whose text holds the query stay, the rest hide
    query = "c_attn"
    page.fill("#search", query)
    want = sum(query in p["fqn"] for p in report["parameters"])
    assert page.locator("tr[data-kind=param]:visible").count() == want > 0
    shown_ops = page.locator(".line.op:visible")
    assert 0 < shown_ops.count() < ops
    assert all(query in t.lower() for t in shown_ops.all_inner_texts())
    assert page.inner_text("#search-count").startswith(f"{want} parameters, ")
    page.fill("#search", "no such thing anywhere")
    assert page.locator("tr[data-kind=param]:visible").count() == 0
    page.fill("#search", "")
    assert page.locator("tr[data-kind=param].hidden").count() == 0
    # memory bars: one per rank; the schedule SVG: one box per compute action
    assert page.locator(".bar[data-rank]").count() == 4
    computes = 2 * 2 * 2   # pp stages x m microbatches x (F, B)
    assert page.locator("#schedule svg rect[fill^='#']").count() >= computes
    _check_timeline(page, trace)
    assert problems == []


def _check_timeline(page, trace):
    """The measured timeline: one box per event of the shown step; another step redraws."""
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = sorted({e["args"]["step"] for e in xs})
    for step in steps:
        page.select_option("#trace-step", str(step))
        want = sum(e["args"]["step"] == step for e in xs)
        assert page.locator("#trace-timeline rect.ev").count() == want
        assert page.get_attribute("#trace-timeline", "data-events") == str(want)
    page.fill("#trace-zoom", "4")
    page.dispatch_event("#trace-zoom", "input")
    width = float(page.get_attribute("#trace-timeline svg", "width"))
    assert width >= 4 * 600


def test_trace_page_draws_every_event(browser, tmp_path):
    from threefold.report.trace_page import trace_html
    trace, _ = synthetic_trace("zbv", 2, 4, v=2, steps=(3, 5))
    path = tmp_path / "trace.html"
    path.write_text(trace_html(trace))
    page, problems = _open(browser, str(path))
    _check_timeline(page, trace)
    assert page.locator("#bubble table").count() == 1
    assert problems == []
