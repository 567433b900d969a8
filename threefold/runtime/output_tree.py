"""The structure of a model's return value, so `pm(x)` returns what the eager model would.

The compiler flattens a model's outputs into tensors (torch.export's pytree order); the
runtime gets those tensors back per microbatch. `describe` (run at trace time on the real
return value) writes the structure as JSON for the manifest, the compile -> run contract;
`rebuild` (runtime) puts the tensors back into it:

    {"tensor": i}                                  the i-th tensor leaf
    {"const": v}                                   a non-tensor leaf (None, a number, a string)
    {"tuple": [...]}, {"list": [...]}              sequences of children
    {"dict": [[key, child], ...]}                  a dict (OrderedDict too), keys in order
    {"class": "module:qualname", "kind": "namedtuple" | "mapping", "keys": [...], "items": [...]}
                                                   a namedtuple, or a keyed class such as a
                                                   Hugging Face ModelOutput

A class is rebuilt only when its module is already imported in this process (a manifest
names code; we never import what it names); otherwise a namedtuple comes back as a tuple
and a keyed class as a dict of its keys, with the same tensors.
"""
from __future__ import annotations

import sys

import torch
from torch.utils import _pytree as pytree

_CONSTANTS = (type(None), bool, int, float, str)


def describe(value) -> dict:
    """The JSON structure of `value` (tensor leaves numbered in pytree order)."""
    counter = [0]

    def walk(spec, leaves):
        if spec.is_leaf():
            leaf = leaves.pop(0)
            if isinstance(leaf, torch.Tensor):
                counter[0] += 1
                return {"tensor": counter[0] - 1}
            return {"const": leaf if isinstance(leaf, _CONSTANTS) else None}
        items = [walk(child, leaves) for child in spec.children()]
        kind, context = spec.type, spec.context
        if kind is tuple:
            return {"tuple": items}
        if kind is list:
            return {"list": items}
        keys = list(context) if isinstance(context, (list, tuple)) else None
        if isinstance(kind, type) and issubclass(kind, dict) and _json_keys(keys):
            if kind.__module__ in ("builtins", "collections"):
                return {"dict": [[k, v] for k, v in zip(keys, items)]}
        if isinstance(context, type) and hasattr(context, "_fields"):    # a namedtuple
            return {"class": _name(context), "kind": "namedtuple", "keys": list(context._fields),
                    "items": items}
        if isinstance(kind, type) and _json_keys(keys) and len(keys) == len(items):
            return {"class": _name(kind), "kind": "mapping", "keys": keys, "items": items}
        return {"tuple": items}    # an unknown container: its leaves, in order

    leaves, spec = pytree.tree_flatten(value)
    return walk(spec, list(leaves))


def rebuild(tree: dict | None, tensors: tuple):
    """The value `tree` describes, with `tensors` as its tensor leaves; None: the tuple."""
    if tree is None:          # an artifact compiled before the structure was recorded
        return tuple(tensors)

    def build(node):
        if "tensor" in node:
            return tensors[node["tensor"]]
        if "const" in node:
            return node["const"]
        if "tuple" in node:
            return tuple(build(c) for c in node["tuple"])
        if "list" in node:
            return [build(c) for c in node["list"]]
        if "dict" in node:
            return {k: build(c) for k, c in node["dict"]}
        items = [build(c) for c in node["items"]]
        cls = _imported(node["class"])
        if node["kind"] == "namedtuple":
            return cls(*items) if cls is not None else tuple(items)
        values = dict(zip(node["keys"], items))
        return cls(**values) if cls is not None else values
    return build(tree)


def _json_keys(keys) -> bool:
    return keys is not None and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys)


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _imported(name: str):
    """The class `module:qualname` if its module is already imported, else None."""
    module, _, qualname = name.partition(":")
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj if isinstance(obj, type) else None
