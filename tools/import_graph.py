"""The threefold package's internal import graph, read from the source (ast; nothing is imported).

    python tools/import_graph.py            # summary: cycles, in-function imports by class
    python tools/import_graph.py --list     # also every in-function import with its class
    python tools/import_graph.py --json     # the same as one JSON object

An edge A -> B is an import statement in module A that names module B (`import threefold.b`,
`from threefold import b`, `from threefold.b import x`, `from .b import x`); an import of a name
that is not a module points at the package that defines it. Importing a submodule also runs its
parents' `__init__`, but those edges are left out, and so is an explicit import of an ancestor
package (`import threefold` for its __version__): a package's `__init__` has always run before
any module inside it runs, so such an import adds no order to satisfy.
Imports under `if TYPE_CHECKING:` never run and are left out.

Two graphs: the module-level one (what runs at import) and the full one (adding the imports
placed inside functions). A strongly connected component of more than one module is a cycle.

Every import placed inside a function or method is classified:
  cycle  - moved to the top of its file it would close a module-level cycle (it dodges one)
  lazy   - it carries a `# lazy: <why>` comment (on its line, or the line above it): deliberate,
           e.g. a heavy optional package (transformers, triton, rich) kept off start-up
  plain  - neither: it could move to the top of its file, or needs a `# lazy:` reason
An import that would close a cycle counts as `cycle` even with a comment.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "threefold"
LAZY = re.compile(r"#\s*lazy:\s*\S")


class Import(NamedTuple):    # (a NamedTuple: tests load this file without registering a module)
    source: str           # importing module, dotted
    target: str           # imported module (internal), or the top-level name (external)
    line: int
    in_function: bool
    internal: bool
    lazy_reason: bool     # a `# lazy: <why>` comment on the line or the line above
    text: str             # the source line, stripped


def module_files(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file of the package."""
    out = {}
    base = os.path.join(root, package)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool = False):
    """(import node, in_function) for every import that can run, in source order."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield from _walk(ast.Module(body=[sub], type_ignores=[]), in_function)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, True)
        else:
            yield from _walk(child, in_function)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    if node.level > 1:
        parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(module: str, is_package: bool, node, modules) -> list[str]:
    """The modules (internal: dotted; external: top-level name) one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(module, is_package, node)
        names = []
        for a in node.names:
            sub = f"{base}.{a.name}"
            names.append(sub if sub in modules else base)
    out = []
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            while name not in modules and "." in name:   # `import threefold.x.y` of a name
                name = name.rsplit(".", 1)[0]
        else:
            name = name.split(".")[0]
        if name not in out:
            out.append(name)
    return out


def collect(root: str = ROOT, package: str = PACKAGE) -> list[Import]:
    modules = module_files(root, package)
    out = []
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        tree = ast.parse(text, filename=path)
        is_package = path.endswith("__init__.py")
        for node, in_function in _walk(tree):
            line = lines[node.lineno - 1]
            above = lines[node.lineno - 2] if node.lineno >= 2 else ""
            # a comment on any line of a parenthesised import counts too
            span = "\n".join(lines[node.lineno - 1:(node.end_lineno or node.lineno)])
            lazy = bool(LAZY.search(span) or (above.strip().startswith("#") and LAZY.search(above)))
            for target in _targets(module, is_package, node, modules):
                if target == module or module.startswith(target + "."):
                    continue     # an ancestor package: it has run before this module runs
                out.append(Import(module, target, node.lineno, in_function, target in modules,
                                  lazy, line.strip()))
    return out


def graph(imports: list[Import], with_functions: bool) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for i in imports:
        g.setdefault(i.source, set())
        if i.internal and (with_functions or not i.in_function):
            g[i.source].add(i.target)
            g.setdefault(i.target, set())
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def _reaches(g: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in g.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def classify(imports: list[Import]) -> list[tuple[Import, str]]:
    """Each in-function import with its class: cycle, lazy or plain (see the module docstring)."""
    top = graph(imports, with_functions=False)
    out = []
    for i in imports:
        if not i.in_function:
            continue
        if i.internal and _reaches(top, i.target, i.source):
            kind = "cycle"
        elif i.lazy_reason:
            kind = "lazy"
        else:
            kind = "plain"
        out.append((i, kind))
    return out


def summary(imports: list[Import]) -> dict:
    internal = [i for i in imports if i.internal]
    classes = classify(imports)
    count = {}
    for scope in ("internal", "external"):
        for kind in ("cycle", "lazy", "plain"):
            count[f"{scope}_{kind}"] = sum(1 for i, k in classes if k == kind and
                                           i.internal == (scope == "internal"))
    return {
        "modules": len(graph(imports, True)),
        "internal_imports": len(internal),
        "internal_in_function": sum(1 for i in internal if i.in_function),
        "external_in_function": sum(1 for i in imports if not i.internal and i.in_function),
        "in_function_by_class": count,
        "cycles_module_level": cycles(graph(imports, with_functions=False)),
        "cycles_with_functions": cycles(graph(imports, with_functions=True)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=ROOT, help="the repository root (default: this checkout)")
    ap.add_argument("--list", action="store_true", help="list every in-function import")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    imports = collect(args.root)
    s = summary(imports)
    if args.json:
        s["in_function"] = [{"source": i.source, "line": i.line, "target": i.target, "class": k}
                            for i, k in classify(imports)]
        print(json.dumps(s, indent=1))
        return 0
    print(f"modules: {s['modules']}; internal imports: {s['internal_imports']}, "
          f"{s['internal_in_function']} inside functions; external imports inside functions: "
          f"{s['external_in_function']}")
    c = s["in_function_by_class"]
    for scope in ("internal", "external"):
        print(f"  {scope:8} in functions: cycle {c[scope + '_cycle']}, lazy {c[scope + '_lazy']}, "
              f"plain {c[scope + '_plain']}")
    for name in ("cycles_module_level", "cycles_with_functions"):
        print(f"{name.replace('_', ' ')}: {len(s[name])}")
        for comp in s[name]:
            print(f"  ({len(comp)}) " + " ".join(comp))
    if args.list:
        for i, kind in classify(imports):
            print(f"{kind:5} {i.source}:{i.line} -> {i.target}   {i.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
