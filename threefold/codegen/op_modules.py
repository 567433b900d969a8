"""Which Python modules register the custom ops a compiled program calls.

A traced graph may call an op that Python code registered (`torch.library.custom_op`:
transformers' `grouped_mm_fallback`, a user's grouped matmul). The generated modules name it
as `torch.ops.ns.name`, which resolves only in a process that ran the registration. `run`
does not import the model's source, so the manifest records, per op, the module that
defines it and the sha256 of that module's file; the loader checks the file and imports
the module (runtime/op_modules.py) before any chunk module. Ops from torch itself and
threefold's own are left out: the runtime has them already.
"""
from __future__ import annotations

import hashlib
import inspect
import sys

import torch
from torch._library.custom_ops import OPDEFS

_BUILTIN = ("torch", "threefold")   # modules whose ops every runtime process has


def op_modules(prog) -> dict[str, dict]:
    """{"ns::name": {"module": dotted name, "sha256": of its source file}} for every
    Python-registered op the chunk graphs call."""
    out: dict[str, dict] = {}
    for chunk in prog.chunks:
        for n in chunk.gm.graph.nodes:
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                qualname = n.target._schema.name
                if qualname not in out:
                    entry = _registering_module(qualname)
                    if entry is not None:
                        out[qualname] = entry
    return out


def _registering_module(qualname: str) -> dict | None:
    opdef = OPDEFS.get(qualname)
    if opdef is None:   # a C++ op (aten, prims, c10d...) or one torch.library.Library made
        return None
    name = getattr(opdef._init_fn, "__module__", None) or ""
    if name.split(".")[0] in _BUILTIN:
        return None
    module = sys.modules.get(name)
    path = inspect.getsourcefile(module) if module is not None else None
    if name == "__main__" or path is None:   # parallelize still works; `run` says why not
        return {"module": name or "<unknown>", "sha256": ""}
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"module": name, "sha256": digest}
