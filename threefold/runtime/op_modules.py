"""Import the modules that register the custom ops an artifact's code calls (the
manifest's `op_modules`, written by codegen/op_modules.py), after checking each module's
file against the sha256 recorded at compile time: the op run is the op compiled.

These are modules of installed libraries or of the user's own package (never generated
code), so they are imported by name through the normal import system; the file hashed is
the file Python's import finds. A module not importable, or whose file changed since
compile, stops the run with one line naming the op, the module and the fix (`run` checks
in the parent before any rank starts; each rank checks again and imports).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util

import torch

from threefold.errors import PlanError


def check_op_modules(op_modules: dict[str, dict], root: str, trust: bool = False) -> list[str]:
    """The modules to import for the ops not yet registered here, each checked."""
    todo = []
    for qualname, entry in sorted(op_modules.items()):
        if _registered(qualname):
            continue
        module = entry["module"]
        where = f"artifact {root!r} calls op {qualname}, registered by module {module!r}"
        if not entry["sha256"]:
            raise PlanError(f"{where}, which a saved artifact cannot import (a script's __main__?): "
                            "define the op in an importable module and recompile")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin or not spec.has_location:
            raise PlanError(f"{where}, which this process cannot import: install it or put it on PYTHONPATH")
        if not trust:
            with open(spec.origin, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != entry["sha256"]:
                    raise PlanError(f"{where}, whose file {spec.origin} changed since compile: "
                                    "recompile the artifact (or run --trust)")
        todo.append(module)
    return todo


def import_op_modules(op_modules: dict[str, dict], root: str, trust: bool = False) -> None:
    for module in check_op_modules(op_modules, root, trust):
        importlib.import_module(module)
    for qualname, entry in sorted(op_modules.items()):
        if not _registered(qualname):
            raise PlanError(f"artifact {root!r} calls op {qualname}, but importing {entry['module']!r} "
                            "did not register it: recompile the artifact")


def _registered(qualname: str) -> bool:
    ns, name = qualname.split("::", 1)
    try:
        getattr(getattr(torch.ops, ns), name)
        return True
    except (AttributeError, RuntimeError):
        return False
