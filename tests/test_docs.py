"""The documentation: the site builds in strict mode, and every code block in README.md and
docs/ runs as written (tests/docs_blocks.py says how blocks are marked and run)."""
import argparse
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.docs_blocks import ROOT, RUNNABLE, all_blocks, blocks, pages, tier

# Blocks that cannot run here (package installs, clusters); each is marked on its page with
# the reason. Keep this small: a block that can run, runs.
MAX_SKIPPED = 6


def test_every_code_block_runs_or_says_why_not():
    found = all_blocks()
    assert found, "no code blocks found"
    for b in found:
        where = f"{b.page} block {b.index}"
        assert b.lang in RUNNABLE + ("toml", "text"), f"{where}: unknown language {b.lang!r}"
        if b.lang == "toml" or (b.lang == "python" and b.action == "file"):
            assert b.action in ("file", "skip"), f"{where}: a {b.lang} block must be a file for later blocks"
        if b.lang == "python":
            compile(b.code, where, "exec")
            if "threefold.launch" in b.code:       # ranks are spawned: they import the file
                assert 'if __name__ == "__main__":' in b.code, where
    skipped = [b for b in found if b.action == "skip"]
    assert len(skipped) <= MAX_SKIPPED, [f"{b.page}: {b.arg}" for b in skipped]
    assert all(b.arg for b in skipped), "every skipped block says why"
    code = [b for b in found if b.lang != "text"]
    ran = [b for b in code if b.action != "skip"]
    print(f"\ndocs code blocks: {len(ran)} run or used of {len(code)} ({len(skipped)} not runnable here)")


def _page_params():
    out = []
    for page in pages():
        if not any(b.action == "run" and b.lang in RUNNABLE for b in blocks(page)):
            continue
        marks = [pytest.mark.slow, pytest.mark.timeout(2400)] if tier(page) == "slow" else [pytest.mark.timeout(900)]
        out.append(pytest.param(page, marks=marks, id=page))
    return out


def _shims(bin_dir):
    os.makedirs(bin_dir)
    for name, line in (("python", f'exec "{sys.executable}" "$@"'),
                       ("threefold", f'exec "{sys.executable}" -m threefold "$@"')):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\n{line}\n")
        os.chmod(path, 0o755)


@pytest.mark.parametrize("page", _page_params())
def test_docs_page_runs(page, tmp_path):
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    os.symlink(os.path.join(ROOT, "examples"), work / "examples")
    _shims(str(tmp_path / "bin"))
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp), THREEFOLD_CACHE_DIR=str(tmp_path / "cache"),
               PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    outputs = []
    for b in blocks(page):
        if b.action == "skip" or b.lang == "text":
            continue
        if b.action == "file":
            (work / b.arg).write_text(b.code)
            continue
        if b.lang == "python":
            script = f"snippet_{b.index}.py"
            (work / script).write_text(b.code)
            cmd = [sys.executable, script]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", b.code]
        out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
        assert out.returncode == 0, f"{page} block {b.index} ({b.lang}) failed:\n{b.code}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        outputs.append(out.stdout)
    if page == "README.md":
        assert re.search(r"final loss \d+\.\d+ on every rank: True", outputs[0]), outputs[0]
        leftover = sorted(n for n in os.listdir(work) if n != "examples" and not n.startswith("snippet_"))
        assert leftover == [], leftover                                # no files left behind
        assert not [n for n in os.listdir(tmp) if n.startswith("threefold")]


def test_every_help_links_a_docs_page_that_exists():
    from threefold.cli.main import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    generated = {f"docs/{uri}" for uri in _reference().PAGES}          # made at build time
    helps = {None: parser.format_help()} | {name: p.format_help() for name, p in sub.choices.items()}
    for name, text in helps.items():
        linked = re.findall(r"(docs/[\w/.-]+\.md)", " ".join(text.split()))
        assert linked, f"threefold {name or ''} --help links no docs page"
        for path in linked:
            assert path in generated or os.path.isfile(os.path.join(ROOT, path)), f"threefold {name} --help links {path}, which is missing"


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference", os.path.join(ROOT, "tools", "docs_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_cover_every_plan_key_env_var_and_command():
    import dataclasses

    from threefold.cli.main import build_parser
    from threefold.plan import Plan
    ref = _reference()
    plan_page = ref.plan_page()
    for f in dataclasses.fields(Plan):
        assert f"| `{f.name}`" in plan_page, f.name
    found = ref.env_vars()
    assert "THREEFOLD_TIMEOUT" in found
    assert not found.keys() - ref.env_docs().keys(), "describe these in threefold/env_check.py VARIABLES"
    cli_page = ref.cli_page()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert f"## threefold {name}" in cli_page
        for a in p._actions:
            for flag in [] if isinstance(a, argparse._HelpAction) else a.option_strings:
                assert f"`{flag}" in cli_page or f", {flag}" in cli_page, (name, flag)
    assert "PlanError" in ref.errors_page() and "`matmul`" in ref.ops_page()


@pytest.mark.timeout(600)
def test_the_site_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "WARNING" not in out.stderr, out.stderr[-4000:]
    for page in ("reference/plan", "reference/cli", "reference/env", "reference/api", "concepts/schedules"):
        assert os.path.isfile(tmp_path / "site" / page / "index.html"), page
    assert (tmp_path / "site" / "concepts" / "schedule-zbv.svg").read_text().startswith("<svg")
