"""MkDocs hook: the reference pages, generated from the code at build time (never copied by hand).

`mkdocs.yml` names this module under `hooks:`. On each build it adds these pages to the site:

    reference/plan.md    every Plan field: its key, default, allowed values and the comment
                         written beside it in threefold/plan.py
    reference/config.md  threefold train's settings: the embedded default.toml
    reference/cli.md     every `threefold` command and flag, read from the argparse parser
    reference/env.md     every THREEFOLD_* variable the package reads, with where it is read
    reference/errors.md  every PlanError message the package can raise, by module
    reference/ops.md     the ops the tensor- and context-parallel passes have rules for
    concepts/mesh-example.svg  the ranks of a pp=2,dp=2,cp=2,tp=2 mesh, from threefold.runtime.mesh
    concepts/schedule-*.svg   each pipeline schedule's timeline, as `threefold schedule --svg` draws it
    benchmarks.md, changelog.md   the repository's BENCHMARKS.md and CHANGELOG.md

A THREEFOLD_* variable read in the code without a line in threefold/env_check.py's VARIABLES
(or a line for one no longer read) is a build warning, so `mkdocs build --strict` (tests/test_docs.py) fails
until it is described.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import logging
import os
import re
import tokenize


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "threefold")
log = logging.getLogger("mkdocs.plugins.threefold")

# --------------------------------------------------------------------------- plan keys

def _field_comments(source: str) -> dict[str, str]:
    """The comment beside each field of `class Plan` (trailing), or the block just above it."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Plan")
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign):
            continue
        line = node.lineno
        text = [comments[line]] if line in comments else []
        above, k = [], line - 1
        while k in comments and source.splitlines()[k - 1].lstrip().startswith("#"):
            above.insert(0, comments[k])
            k -= 1
        out[node.target.id] = " ".join(above + text)
    return out


def plan_page() -> str:
    from threefold import plan as plan_mod
    from threefold.plan import Plan
    with open(plan_mod.__file__) as f:
        comments = _field_comments(f.read())
    short = {v: k for k, v in getattr(plan_mod, "_ALIASES", {}).items()}
    choices = {"schedule": "SCHEDULES", "loss": "LOSS_MODES", "batchnorm": "BATCHNORM_MODES",
               "recompute": "RECOMPUTE_MODES", "dtype": "DTYPES", "compile": "COMPILE_MODES",
               "zero": "ZERO_STAGES"}
    lines = ["# Plan keys", "",
             "Generated from the fields of `threefold.Plan` (threefold/plan.py) and the comments "
             "beside them. A plan is a string of `key=value` pairs separated by commas "
             "(`Plan.parse(\"tp=2,pp=2,m=4\")`) or a `threefold.Plan(...)` value; "
             "what a string leaves out is filled in by the rule in "
             "[Getting started](../getting-started.md#what-a-plan-string-leaves-out).", "",
             "| key | default | values | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(Plan):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        key = f"`{f.name}`" + (f" (`{short[f.name]}`)" if f.name in short else "")
        values = getattr(plan_mod, choices[f.name], None) if f.name in choices else None
        values = " \\| ".join(f"`{v}`" for v in values) if values else str(f.type).replace("|", "\\|")
        doc = comments.get(f.name, "").replace("|", "\\|")
        lines.append(f"| {key} | `{default!r}` | {values} | {doc} |")
    return "\n".join(lines) + "\n"


def config_page() -> str:
    with open(os.path.join(PACKAGE, "configs", "default.toml")) as f:
        text = f.read()
    return ("# Configuration of `threefold train`\n\n"
            "The embedded defaults (`threefold/configs/default.toml`, included here at build time). "
            "Every key is also a flag (`--name-with-dashes`); `--config FILE` reads a file of the "
            "same form, and `threefold train --print-config` prints the resolved values. Order: "
            "these defaults < `--config FILE` < flags.\n\n```toml\n" + text + "```\n")


# --------------------------------------------------------------------------- CLI

def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | help |", "|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(a.option_strings) or a.dest
        if a.metavar and a.option_strings and a.nargs != 0:
            name += f" {a.metavar}"
        if a.choices:
            name += " {" + ",".join(map(str, a.choices)) + "}"
        default = "" if a.default in (None, argparse.SUPPRESS, False) else f"`{a.default}`"
        text = (a.help or "").replace("%(default)s", str(a.default)).replace("%%", "%")
        cell = lambda s: s.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{cell(name)}` | {cell(default)} | {cell(text)} |")
    return rows


def cli_page() -> str:
    from threefold.cli.main import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    lines = ["# Command line", "",
             "Generated from the argparse parser of `threefold` (threefold/cli/). Every command "
             "exits 0 on success, 1 when a check it ran failed, and 2 with a one-line reason "
             "for bad input.", "", "```text", parser.format_usage().strip(), "```", ""]
    for name, p in sub.choices.items():
        lines += [f"## threefold {name}", "", helps.get(name) or p.description or "", "",
                  "```text", p.format_usage().strip(), "```", ""]
        if p.description and helps.get(name):
            lines += [p.description, ""]
        lines += _flag_rows(p) + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- env vars, errors

def _sources():
    for dirpath, _, names in os.walk(PACKAGE):
        for n in sorted(names):
            if n.endswith(".py"):
                path = os.path.join(dirpath, n)
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), f.read()


def env_vars() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for rel, text in _sources():
        for name in sorted(set(re.findall(r"\bTHREEFOLD_[A-Z0-9_]*[A-Z0-9]\b", text))):
            found.setdefault(name, []).append(rel)
    return dict(sorted(found.items()))


def env_docs() -> dict[str, str]:
    from threefold.env_check import VARIABLES
    return {name: doc for name, (_, doc) in VARIABLES.items()}


def env_page() -> str:
    found, docs = env_vars(), env_docs()
    for name in found.keys() - docs.keys():
        log.warning(f"reference/env.md: {name} is read in {found[name][0]} but has no line in "
                    f"threefold/env_check.py VARIABLES")
    for name in docs.keys() - found.keys():
        log.warning(f"reference/env.md: VARIABLES describes {name}, which the package no longer reads")
    lines = ["# Environment variables", "",
             "Every `THREEFOLD_*` variable the package reads (found in its source at build time) "
             "and where. torch's own variables (`TORCHINDUCTOR_CACHE_DIR`, torchrun's `RANK`, "
             "`WORLD_SIZE`, `MASTER_ADDR`) work as torch documents them.", "",
             "| variable | what it does | read in |", "|---|---|---|"]
    for name, files in found.items():
        where = ", ".join(f"`{f}`" for f in files)
        lines.append(f"| `{name}` | {docs.get(name, '(undocumented)')} | {where} |")
    return "\n".join(lines) + "\n"


def _message(node: ast.AST) -> str:
    """A PlanError's first argument as text, with each `{expression}` kept as `{...}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message(node.left) + _message(node.right)
    return "{" + ast.unparse(node) + "}"


def plan_errors() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rel, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "PlanError" and node.exc.args):
                out.setdefault(rel, []).append(" ".join(_message(node.exc.args[0]).split()))
    return out


def errors_page() -> str:
    found = plan_errors()
    total = sum(map(len, found.values()))
    lines = ["# PlanError messages", "",
             f"Every `raise PlanError(...)` in the package ({total} in {len(found)} modules), read "
             "from the source at build time; `{...}` stands for a value filled in when it is "
             "raised. The CLI prints one as `threefold COMMAND: error: MESSAGE` and exits 2. "
             "The common ones and their fixes: [When a model is refused](../guides/refusals.md).", ""]
    for rel, messages in found.items():
        lines += [f"## `{rel}`", ""]
        lines += [f"- `{m.replace('`', chr(39))}`" for m in messages] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- ops

def ops_page() -> str:
    from threefold.passes import cp_rules, tp_rules
    by_rule: dict[str, list[str]] = {}
    for op, rule in sorted(tp_rules.RULES.items()):
        by_rule.setdefault(getattr(rule, "__name__", "rule"), []).append(f"`{op}`")
    for family, rule in sorted(tp_rules.REGISTRY.by_family.items()):
        by_rule.setdefault(rule.__name__, []).insert(0, "every op ATen tags pointwise (random ops excepted)"
                                                     if family == "pointwise" else f"every op of the {family} family")
    lines = ["# Op support", "",
             "Generated from the rule tables of the passes. An op outside these tables still "
             "runs: under tp its inputs are gathered to whole values first (a *fallback*, "
             "listed by `threefold inspect`; `strict=true` makes it an error), under cp it runs "
             "on the all-gathered sequence. Matmuls and linear layers are sharded by the "
             "column/row pairing of passes/tensor_parallel.py, not by this table.", "",
             "## Tensor parallelism (`threefold/passes/tp_rules*.py`, registered by op or by family)", "",
             "| rule | ATen ops |", "|---|---|"]
    for rule, ops in sorted(by_rule.items()):
        lines.append(f"| `{rule}` | {', '.join(ops)} |")
    lines += ["", "## Context parallelism (`threefold/passes/cp_rules/`)", "",
              "| family | ATen ops |", "|---|---|"]
    for name, value in sorted(vars(cp_rules).items()):
        if name.isupper() or (name.startswith("_") and name[1:].isupper()):
            if isinstance(value, (set, frozenset)) and all(isinstance(v, str) for v in value):
                family = name.strip("_").lower().replace("_", " ")
                lines.append(f"| {family} | {', '.join(f'`{o}`' for o in sorted(value))} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the hook

PAGES = {"reference/plan.md": plan_page, "reference/config.md": config_page, "reference/cli.md": cli_page, "reference/env.md": env_page,
         "reference/errors.md": errors_page, "reference/ops.md": ops_page}
# Pictures the runtime draws (`threefold schedule --svg`), made at build time.
SCHEDULES = {"gpipe": (4, 8, 1), "1f1b": (4, 8, 1), "interleaved": (4, 8, 2), "zb-h1": (4, 8, 1),
             "zbv": (4, 8, 2)}


def schedule_svg(kind: str) -> str:
    from threefold.runtime.schedule import make_schedule
    from threefold.runtime.simulate import verify
    from threefold.runtime.timeline_svg import render_svg
    pp, m, v = SCHEDULES[kind]
    return render_svg(verify(make_schedule(kind, pp, m, v)).simulation,
                      title=f"{kind}: pp={pp}, m={m}" + (f", v={v}" if v > 1 else ""))


def mesh_svg(plan_text: str = "pp=2,dp=2,cp=2,tp=2") -> str:
    """Every rank of a plan's mesh as a box: one row per pipeline stage, coordinates inside."""
    from threefold.plan import Plan
    mesh = Plan.parse(plan_text).mesh
    pp = mesh.size("pp")
    per = mesh.world_size // pp
    w, h, pad = 96, 58, 12
    colours = ["#e8f0fe", "#e6f4ea", "#fef7e0", "#fce8e6"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{per * w + 2 * pad + 70}" '
           f'height="{pp * h + 2 * pad + 24}" font-family="sans-serif" font-size="11">',
           f'<text x="{pad}" y="{pad + 6}" font-size="13" font-weight="bold">{plan_text}: '
           f'rank = tp + tp*(cp + cp*(dp + dp*pp))</text>']
    for r in range(mesh.world_size):
        c = mesh.coord(r)
        x, y = pad + 70 + (r % per) * w, pad + 20 + (r // per) * h
        out.append(f'<rect x="{x}" y="{y}" width="{w - 6}" height="{h - 6}" rx="5" stroke="#444" '
                   f'fill="{colours[c.dp % len(colours)]}"/>')
        out.append(f'<text x="{x + 6}" y="{y + 16}" font-weight="bold">rank {r}</text>')
        out.append(f'<text x="{x + 6}" y="{y + 32}">dp {c.dp} cp {c.cp}</text>')
        out.append(f'<text x="{x + 6}" y="{y + 46}">tp {c.tp}</text>')
    for s in range(pp):
        out.append(f'<text x="{pad}" y="{pad + 20 + s * h + 30}">stage {s}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


ROOT_PAGES = {"benchmarks.md": "BENCHMARKS.md", "changelog.md": "CHANGELOG.md"}


def site_links(text: str) -> str:
    """Links of a repository-root page, as they resolve inside the site (docs/ is its root)."""
    text = re.sub(r"\]\(docs/", "](", text)
    for name, uri in (("BENCHMARKS.md", "benchmarks.md"), ("CHANGELOG.md", "changelog.md")):
        text = text.replace(f"]({name}", f"]({uri}")
    return text


def on_files(files, config):
    import sys

    from mkdocs.structure.files import File
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    files.append(File.generated(config, "concepts/mesh-example.svg", content=mesh_svg()))
    for kind in SCHEDULES:
        files.append(File.generated(config, f"concepts/schedule-{kind}.svg", content=schedule_svg(kind)))
    for uri, name in ROOT_PAGES.items():
        with open(os.path.join(ROOT, name)) as f:
            files.append(File.generated(config, uri, content=site_links(f.read())))
    return files
