"""SPEC strings and workloads: `path/to/file.py:factory` or `pkg.module:factory`.

The factory returns a `Workload` or a dict with keys model, inputs (tuple), target, loss_fn
(target and loss_fn may be absent for forward-only use). Factory keyword arguments can be
given after the name: `examples/gpt.py:workload(n_layer=8,seq=32)`.

For training on more than one batch the dict may also give a data source: `batches`, a
callable `batches(step) -> (inputs..., target)` or an iterable of such batches (one per
step), and optionally `val_batches` (a list or iterable of batches, or a callable of the
index) and `tokenizer` (with encode/decode, for text samples). With `batches`, `inputs` and
`target` may be left out: the first batch is the example the model is compiled for.
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
    # Training data (threefold train): batches(step) or an iterable of (inputs..., target);
    # None: `inputs` and `target` are the one batch of every step.
    batches: Any = None
    val_batches: Any = None      # validation batches: a list/iterable or a callable of the index
    tokenizer: Any = None        # encode(text) -> ids, decode(ids) -> text (samples, generate)

    @classmethod
    def coerce(cls, value, name: str = "") -> "Workload":
        if isinstance(value, Workload):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"model", "inputs", "target", "loss_fn", "name", "batch_dims",
                                    "batches", "val_batches", "tokenizer"}
            if unknown or "model" not in value or ("inputs" not in value and value.get("batches") is None):
                raise PlanError(f"workload {name!r} returned a dict with keys {sorted(value)}: it needs "
                                "'model' and 'inputs' (and optionally 'target', 'loss_fn', 'batch_dims', "
                                "'batches', 'val_batches', 'tokenizer')")
            batches = value.get("batches")
            if batches is not None and not callable(batches) and not _iterable(batches):
                raise PlanError(f"workload {name!r}: 'batches' is a {type(batches).__name__}: give a callable "
                                "batches(step) -> (inputs..., target) or an iterable of such batches")
            inputs, target = value.get("inputs"), value.get("target")
            if inputs is None:   # the data source's first batch is the example
                # lazy: start-up: train.source loads only on this path
                from threefold.train.source import peek_first
                (*inputs, target), batches = peek_first(batches, name)
            inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
            return cls(value["model"], inputs, target, value.get("loss_fn"),
                       value.get("name", name), value.get("batch_dims"), batches,
                       value.get("val_batches"), value.get("tokenizer"))
        raise PlanError(f"workload {name!r} returned {type(value).__name__}: return a dict with "
                        "keys model, inputs, target, loss_fn (or a threefold.Workload)")


def _iterable(value) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return not isinstance(value, (str, bytes, torch.Tensor))


def load_spec(spec: str, sizes: dict | None = None) -> Workload:
    """Import the factory a SPEC names and call it. `sizes` ({"batch": 32, "seq": 128}, what
    train's --batch/--seq set) go to factory parameters of those names; a factory without
    one is a PlanError (the flag would mean nothing)."""
    factory, kwargs = resolve_spec(spec)
    if sizes:
        # lazy: start-up: train.source loads only on this path
        from threefold.train.source import factory_overrides
        kwargs = {**kwargs, **factory_overrides(factory, spec, sizes, kwargs)}
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
    # Let the file import its siblings (examples/foo.py importing examples/bar.py). The entry
    # is a string object of its own, so that the one removed afterwards is this one even when
    # the file inserts its own folder (an equal string) in front of it.
    folder = os.path.dirname(path)
    entry = (folder + "/")[:-1]
    sys.path.insert(0, entry)
    try:
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise PlanError(f"SPEC file {path!r} failed to import: {type(exc).__name__}: {text}") from None
    finally:
        _remove_entry(sys.path, entry)
    return module


def _remove_entry(paths: list, entry: str) -> None:
    """Removes `entry` itself (by identity) from `paths`, if it is still there."""
    for i, p in enumerate(paths):
        if p is entry:
            del paths[i]
            return
