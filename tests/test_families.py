"""Op families have one home (threefold/ops/families.py, issue 39 item 1): the passes, cost
and fusion ask it, and keep no op-name lists of their own."""
from __future__ import annotations

import ast
import operator
import os

import torch
import torch.nn.functional as F

from threefold.ops import families as fam

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# files whose lists move to families.py with the work under way on them (context and expert
# parallelism); an entry here is a debt, not a permission
PENDING: set = set()
# module-level sets of op names that are not families: per-op rule tables and kernel names
NOT_FAMILIES = {
    (os.path.join("threefold", "passes", "cost.py"), "_SAVES_NOTHING"),        # SAVE_RULES: per-op autograd facts
    (os.path.join("threefold", "planner", "moe.py"), "ROUTING_KERNELS"),       # a MoE layer's kernels, by role
    (os.path.join("threefold", "passes", "cp_rules", "core.py"), "GATHERABLE"),  # family names, not op names
}


def _aten_packets() -> set[str]:
    return {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}


def _named_sets() -> dict[str, frozenset]:
    return {k: v for k, v in vars(fam).items() if k.isupper() and isinstance(v, frozenset)}


def test_every_name_is_an_aten_op_or_a_function_the_graph_calls():
    """A misspelt name in a set would never match (silently): each is an ATen op packet, a
    function of the runtime the compiler emits, or a Python function fx records by name."""
    from threefold.runtime import eager_loss, tp_ops
    runtime = {getattr(v, "__name__", None) for m in (tp_ops, eager_loss) for v in vars(m).values() if callable(v)}
    python = {operator.getitem.__name__, F.cross_entropy.__name__, torch.tensor.__name__}
    custom = {"grouped_mm", "grouped_mm_fallback"}   # transformers' grouped matmul, as a custom op
    names = set().union(*_named_sets().values())
    unknown = sorted(names - _aten_packets() - runtime - python - custom)
    assert unknown == [], f"not an ATen op or a known function: {unknown}"


def _literal_strings(node: ast.AST) -> list[str]:
    return [e.value for sub in ast.walk(node) if isinstance(sub, (ast.Set, ast.Tuple, ast.List))
            for e in sub.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def test_passes_keep_no_op_name_lists_of_their_own():
    """A module-level set of 3+ ATen op names outside families.py is a family kept twice
    (rule registrations and per-op tables, which are dicts, are not lists)."""
    packets, found = _aten_packets(), []
    for pkg in ("passes", "compiler", "codegen", "planner", "ir"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, "threefold", pkg)):
            for name in sorted(files):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                if not name.endswith(".py") or rel in PENDING or os.path.dirname(rel) in PENDING:
                    continue
                with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in tree.body:
                    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or isinstance(node.value, ast.Dict):
                        continue
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    if (rel, getattr(target, "id", "")) in NOT_FAMILIES:
                        continue
                    ops = [s for s in _literal_strings(node.value) if s in packets]
                    if len(ops) >= 3:
                        found.append(f"{rel}:{node.lineno} {ops[:4]}")
    assert found == [], "op-name lists outside threefold/ops/families.py: " + "; ".join(found)


def test_named_sets_are_built_from_the_families():
    """The questions passes ask are answered from the families: a view family member is
    followed by in-place tracking, the cost model and the batch-row rules alike."""
    assert fam.RESHAPES <= fam.ALIASING <= fam.ROW_VIEWS
    assert fam.VIEWS <= fam.NO_ARITHMETIC and fam.COPIES <= fam.NO_ARITHMETIC
    assert fam.COPIES <= fam.LAYOUT_ONLY and fam.COPIES <= fam.SAME_MATRIX
    assert fam.SPLITS <= fam.SLICING and fam.SPLITS <= fam.ALIASING_PIECES
    assert fam.GEMMS <= fam.ROW_MATMULS and fam.REDUCTIONS <= fam.ROW_REDUCTIONS and fam.CONVS <= fam.ROW_CONVS
    assert not (fam.MORE_REDUCTIONS & set().union(*fam.FAMILIES.values())), "a 'more' op already has a family"
