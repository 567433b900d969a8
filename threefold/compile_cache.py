"""A command's compile, handed to its ranks: `train` and `check` compile the workload in the
parent (so a plan that cannot work fails before any rank starts), and rank 0's
`parallelize` would compile the same model again: on a small job that second compile was
a third of the start-up. The parent writes what every rank needs (sources, manifest,
lifted constants) to a private file named by THREEFOLD_COMPILED; rank 0 uses it when its
own workload has the same key (plan, model structure, parameter shapes, input shapes,
loss), and compiles as before otherwise.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile

import torch

ENV = "THREEFOLD_COMPILED"


def workload_key(model, inputs: tuple, target, loss_fn, plan, batch_dims=None) -> str:
    """What the compiled program depends on besides the weights' values."""
    def tensor(t):
        return [list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(type(t))
    described = {
        "plan": str(plan),
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "params": [[n, *tensor(p), p.requires_grad] for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [[n, *tensor(b)] for n, b in model.named_buffers()],
        "modules": [f"{n}:{type(m).__qualname__}" for n, m in model.named_modules()],
        "training": model.training,
        "inputs": [tensor(t) for t in inputs],
        "target": tensor(target) if target is not None and loss_fn is not None else None,
        "loss_fn": getattr(loss_fn, "__qualname__", repr(type(loss_fn))) if loss_fn is not None else None,
        "batch_dims": repr(batch_dims),
    }
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def hand_to_ranks(prog, key: str) -> None:
    """Write the payload of a compiled program for this process's ranks (they inherit ENV)."""
    # lazy: start-up: codegen.artifact loads only on this path
    from threefold.codegen.artifact import build_manifest, build_sources
    sources = build_sources(prog)
    manifest = build_manifest(prog, sources, {}, with_weights=False)
    # the file table its JSON form is checked against (the sources travel beside it)
    manifest = manifest.replace(files={**manifest.files, **{name: hashlib.sha256(text.encode()).hexdigest()
                                                             for name, text in sources.items()}})
    payload = {"key": key, "sources": sources, "manifest": manifest.dumps(),   # JSON text: no pickle
               "constants": {k: v for k, v in prog.state.items() if k.startswith("_const.")}}
    directory = tempfile.mkdtemp(prefix="threefold-compiled-")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, "payload.pt")
    torch.save(payload, path)
    os.environ[ENV] = path


def take(key: str) -> dict | None:
    """The parent's payload when it was compiled for this key, else None."""
    path = os.environ.get(ENV)
    if not path or not os.path.isfile(path):
        return None
    try:
        payload = torch.load(path, weights_only=True)
    except Exception:   # unreadable: compile as before
        return None
    if payload.get("key") != key:
        return None
    # lazy: start-up: runtime.manifest loads only on this path
    from threefold.runtime.manifest import Manifest
    return {"sources": payload["sources"], "manifest": Manifest.from_json(json.loads(payload["manifest"])),
            "constants": payload["constants"]}
