"""The layering docs/design.md promises, read from the source (ast; nothing is imported):
no import cycles, the runtime free of the front end, the compiler free of SPEC files,
compiler/ -> passes/ in one direction, the engine changed only through its own methods, and
every import placed inside a function lazy on purpose (tools/import_graph.py measures it all)."""
from __future__ import annotations

import ast
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "tools", "import_graph.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)     # a file, not a package: sys.path is left alone
    return mod


@pytest.fixture(scope="module")
def tool():
    return _tool()


@pytest.fixture(scope="module")
def imports(tool):
    return tool.collect(ROOT)


def _in(module: str, *packages: str) -> bool:
    return any(module == f"threefold.{p}" or module.startswith(f"threefold.{p}.") for p in packages)


def test_the_tool_finds_a_cycle_and_a_dodge(tool, tmp_path):
    """The measurement itself: a two-module cycle through a function is found and classed."""
    pkg = tmp_path / "threefold"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from threefold import b\n")
    (pkg / "b.py").write_text("def f():\n    from threefold.a import x\n\n"
                              "def g():\n    import json  # lazy: a reason\n")
    found = tool.collect(str(tmp_path))
    assert tool.cycles(tool.graph(found, with_functions=True)) == [["threefold.a", "threefold.b"]]
    assert tool.cycles(tool.graph(found, with_functions=False)) == []
    assert sorted(k for _, k in tool.classify(found)) == ["cycle", "lazy"]


# The tensor-parallel rules import each other; their rewrite (issue 39's rule registry, on its
# own branch) removes this. Nothing else may join a cycle.
KNOWN_CYCLES: set[frozenset] = set()   # none: a cycle is broken, never listed


def test_no_import_cycles(tool, imports):
    for with_functions in (False, True):
        for comp in tool.cycles(tool.graph(imports, with_functions)):
            assert any(set(comp) <= known for known in KNOWN_CYCLES), \
                f"import cycle ({'with' if with_functions else 'without'} in-function imports): {comp}"


def test_no_in_function_import_dodges_a_cycle(tool, imports):
    dodges = [f"{i.source}:{i.line} -> {i.target}" for i, kind in tool.classify(imports)
              if kind == "cycle" and not any({i.source, i.target} <= k for k in KNOWN_CYCLES)]
    assert dodges == []


def test_every_in_function_import_says_why_it_is_lazy(tool, imports):
    """An import inside a function is deliberate (start-up: a heavy or optional package, a
    part only one command needs) and says so: `# lazy: <why>`."""
    silent = [f"{i.source}:{i.line}  {i.text}" for i, kind in tool.classify(imports)
              if kind == "plain"]
    assert silent == [], "in-function imports without a `# lazy: <why>` comment:\n" + "\n".join(silent)


def test_runtime_imports_nothing_of_the_front_end_or_the_compiler(imports):
    """A saved artifact runs with the runtime alone: no CLI, report pages, checkpoint I/O,
    front-end Plan, compiler, passes, codegen or IR (even inside functions)."""
    bad = [f"{i.source}:{i.line} -> {i.target}" for i in imports
           if i.internal and _in(i.source, "runtime")
           and (_in(i.target, "cli", "report", "checkpoint", "compiler", "passes", "codegen", "ir",
                    "planner", "train", "plan", "api", "workload"))]
    assert bad == []


def test_the_compiler_never_loads_spec_files(imports):
    """compiler/, passes/, codegen/ and ir/ take workload values; SPEC strings are loaded by
    the front end (threefold/api.py `compile`, the CLI)."""
    bad = []
    for rel in _files("compiler", "passes", "codegen", "ir"):
        for node in ast.walk(_parse(rel)):
            if isinstance(node, ast.ImportFrom) and node.module == "threefold.workload":
                bad += [f"{rel}:{node.lineno} {a.name}" for a in node.names if a.name != "Workload"]
            elif isinstance(node, ast.Import):
                bad += [f"{rel}:{node.lineno} {a.name}" for a in node.names if a.name == "threefold.workload"]
            elif isinstance(node, ast.Attribute) and node.attr in ("load_spec", "resolve_spec"):
                bad.append(f"{rel}:{node.lineno} .{node.attr}")
    assert bad == []


def test_compiler_and_passes_import_in_one_direction(imports):
    """compiler/ orchestrates (its pipeline imports the passes); passes read ir/, never
    compiler/; ir/ imports neither."""
    back = [f"{i.source}:{i.line} -> {i.target}" for i in imports if i.internal
            and ((_in(i.source, "passes") and _in(i.target, "compiler"))
                 or (_in(i.source, "ir") and _in(i.target, "compiler", "passes", "codegen")))]
    assert back == []
    assert any(_in(i.source, "compiler") and _in(i.target, "passes") for i in imports)


def _files(*packages):
    for p in packages:
        for dirpath, _, names in os.walk(os.path.join(ROOT, "threefold", p)):
            for n in sorted(names):
                if n.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, n), ROOT)


def _parse(rel: str) -> ast.Module:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return ast.parse(f.read(), filename=rel)


def _is_engine(expr) -> bool:
    """`engine`, `self.engine`, `pm.engine`, `self._engine`: the object is an engine."""
    name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""
    return name.lstrip("_") in ("engine", "eng")


def test_nothing_outside_the_engine_sets_its_fields():
    """PipelineEngine is not a hub others write: zero, optimizers, trace, grad_norm and
    checkpoint load call its registration methods instead."""
    bad = []
    for rel in _files(""):
        if rel == os.path.join("threefold", "runtime", "engine.py"):
            continue
        for node in ast.walk(_parse(rel)):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and _is_engine(sub.value):
                        bad.append(f"{rel}:{node.lineno} assigns .{sub.attr} of an engine")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "delattr") and node.args and _is_engine(node.args[0]):
                bad.append(f"{rel}:{node.lineno} {node.func.id} on an engine")
            if isinstance(node, ast.Attribute) and node.attr == "__dict__" and _is_engine(node.value):
                bad.append(f"{rel}:{node.lineno} reaches into an engine's __dict__")
    assert bad == []


@pytest.mark.parametrize("rel, method", [
    ("runtime/zero.py", "use_grad_sync"), ("runtime/optimizers.py", "use_optimizer"),
    ("runtime/optimizers.py", "set_loss_scale"), ("runtime/trace.py", "traced"),
    ("checkpoint/load.py", "restore_counters"), ("checkpoint/save.py", "counters"),
])
def test_the_engine_is_changed_through_its_methods(rel, method):
    """Each part that used to set an engine field calls the engine's method for it, and the
    engine defines that method."""
    calls = {n.func.attr for n in ast.walk(_parse(os.path.join("threefold", rel)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert method in calls
    engine = _parse(os.path.join("threefold", "runtime", "engine.py"))
    assert method in {f.name for f in ast.walk(engine) if isinstance(f, ast.FunctionDef)}
