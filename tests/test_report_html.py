"""`threefold inspect --html` without a browser: one self-contained file (no network, no
external resource) holding every parameter, every chunk's generated op lines with their
module, the memory bars and the schedule; bad --html/--trace input is a one-line error."""
from __future__ import annotations

import os
import re

import pytest

from tests.parity import ROOT
from threefold.cli.main import main

SPEC = "examples/gpt.py:workload(n_layer=2,n_embd=16,n_head=2,vocab_size=32,seq=8,batch=4)"


@pytest.fixture()
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_inspect_html_is_self_contained_and_complete(tmp_path, in_root):
    from threefold.cli.inspect_cmd import chunk_report, write_html
    from threefold.codegen.artifact import build_sources
    from threefold.compiler.api import compile_workload
    from threefold.workload import load_spec
    from threefold.report.code_view import split_line
    prog = compile_workload(load_spec(SPEC), "pp=2,m=2")
    report = chunk_report(prog)    # what inspect --json prints; `inspect --html` writes this page
    page = tmp_path / "r.html"
    write_html(prog, report, str(page))
    html = page.read_text()
    # nothing fetched: no external scripts, styles, images or links (the SVG namespace is a name)
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|url\(|@import", html)
    assert "http" not in html.replace("http://www.w3.org/2000/svg", "")
    for p in report["parameters"]:
        assert f'data-search="{p["fqn"].lower()}' in html
    sources = build_sources(prog)
    ops = sum(split_line(line)[1] is not None for text in sources.values() for line in text.splitlines())
    assert html.count('class="line op"') == ops > 20
    assert html.count('class="bar" data-rank=') == 2 and "<svg" in html


def test_code_lines_name_their_module():
    from threefold.report.code_view import split_line
    code, module = split_line("        h0_ln_1 = aten.layer_norm.default(  # h.0.ln_1  R  [2, 16, 64]")
    assert module == "h.0.ln_1" and code.endswith("aten.layer_norm.default(")
    assert split_line("    PARAMS = {") == ("    PARAMS = {", None)
    assert split_line("# content-hash: b23c4a25478c1dd9")[1] is None


def test_trace_needs_html_and_a_trace_file(tmp_path, in_root, capsys):
    assert main(["inspect", SPEC, "--trace", str(tmp_path / "t.json")]) == 2
    assert "--trace needs --html" in capsys.readouterr().err
    bad = tmp_path / "t.json"
    bad.write_text('{"not": "a trace"}')
    assert main(["inspect", SPEC, "--html", str(tmp_path / "r.html"), "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not a threefold trace" in err and len(err.strip().splitlines()) == 1
    assert main(["inspect", SPEC, "--html", str(tmp_path / "nodir" / "r.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r.html")
