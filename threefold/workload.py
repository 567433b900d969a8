"""SPEC strings and workloads: `path/to/file.py:factory` or `pkg.module:factory`.

The factory returns a `Workload` or a dict with keys model, inputs (tuple), target, loss_fn
(target and loss_fn may be absent for forward-only use). Factory keyword arguments can be
given after the name: `examples/gpt.py:workload(n_layer=8,seq=32)`.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from threefold.errors import PlanError


@dataclass
class Workload:
    model: torch.nn.Module
    inputs: tuple
    target: Any = None
    loss_fn: Callable | None = None
    name: str = ""
    # Batch dimension of each input (model inputs, then the target), None = not split; or one
    # int for all. None (default): found from the inputs (passes/batch_dims.py).
    batch_dims: Any = None

    @classmethod
    def coerce(cls, value, name: str = "") -> "Workload":
        if isinstance(value, Workload):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"model", "inputs", "target", "loss_fn", "name", "batch_dims"}
            if unknown or "model" not in value or "inputs" not in value:
                raise PlanError(f"workload {name!r} returned a dict with keys {sorted(value)}: it needs "
                                "'model' and 'inputs' (and optionally 'target', 'loss_fn', 'batch_dims')")
            inputs = value["inputs"]
            inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
            return cls(value["model"], inputs, value.get("target"), value.get("loss_fn"),
                       value.get("name", name), value.get("batch_dims"))
        raise PlanError(f"workload {name!r} returned {type(value).__name__}: return a dict with "
                        "keys model, inputs, target, loss_fn (or a threefold.Workload)")


def load_spec(spec: str) -> Workload:
    """Import the factory a SPEC names and call it."""
    factory, kwargs = resolve_spec(spec)
    try:
        value = factory(**kwargs)
    except PlanError:
        raise
    except TypeError as exc:
        raise PlanError(f"SPEC {spec!r}: calling the factory failed ({exc}); check its arguments") from None
    except Exception as exc:  # user code: one line naming the SPEC and what it raised
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise PlanError(f"SPEC {spec!r}: the factory raised {type(exc).__name__}"
                        f"{': ' + text if text else ''}; fix the factory") from None
    workload = Workload.coerce(value, spec)
    if not isinstance(workload.model, torch.nn.Module):
        raise PlanError(f"SPEC {spec!r}: 'model' is a {type(workload.model).__name__}, not a torch.nn.Module")
    workload.name = workload.name or spec
    return workload


def resolve_spec(spec: str) -> tuple[Callable, dict]:
    if not isinstance(spec, str) or ":" not in spec:
        raise PlanError(f"SPEC {spec!r} is malformed: write path/to/file.py:factory or pkg.module:factory")
    target, _, call = spec.rpartition(":")
    name, kwargs = _parse_call(spec, call)
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise PlanError(f"SPEC {spec!r}: file {target!r} does not exist")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PlanError(f"SPEC {spec!r}: cannot import module {target!r} ({exc})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise PlanError(f"SPEC {spec!r}: {target!r} has no callable named {name!r}")
    return factory, kwargs


def _parse_call(spec: str, call: str) -> tuple[str, dict]:
    if "(" not in call:
        if not call.isidentifier():
            raise PlanError(f"SPEC {spec!r}: {call!r} is not a factory name")
        return call, {}
    try:
        node = ast.parse(call, mode="eval").body
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
        return node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except Exception:
        raise PlanError(f"SPEC {spec!r}: write factory arguments as name(key=value, ...) with literal values") from None


def _import_file(path: str):
    mod_name = "_threefold_spec_" + os.path.splitext(os.path.basename(path))[0]
    if mod_name in sys.modules and getattr(sys.modules[mod_name], "__file__", None) == path:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    # Let the file import its siblings (examples/foo.py importing examples/bar.py).
    sys.path.insert(0, os.path.dirname(path))
    try:
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise PlanError(f"SPEC file {path!r} failed to import: {type(exc).__name__}: {text}") from None
    finally:
        sys.path.pop(0)
    return module
