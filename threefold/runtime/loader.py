"""Load a saved artifact's per-rank modules, without the compiler or the model's source.

An artifact directory holds manifest.json, one generated `.py` per (chunk, tp rank),
`kernels.py` when fusion made kernels, and `weights/*.safetensors` keyed by original FQNs
(absent for models compiled on the meta device).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass

import torch

from threefold.errors import PlanError
from threefold.runtime.module import ChunkModule

MANIFEST = "manifest.json"
BATCH_FILE = "batch.safetensors"   # the workload's example global batch, when saved


@dataclass
class Artifact:
    root: str
    manifest: dict

    @property
    def plan(self) -> str:
        return self.manifest["plan"]

    @property
    def chunks(self) -> list[dict]:
        return self.manifest["chunks"]

    def module_path(self, chunk: int, tp_rank: int) -> str:
        return os.path.join(self.root, self.chunks[chunk]["modules"][str(tp_rank)])

    def weights_path(self, chunk: int, tp_rank: int) -> str | None:
        rel = self.chunks[chunk].get("weights", {}).get(str(tp_rank))
        return os.path.join(self.root, rel) if rel else None


def load_batch(art: Artifact) -> tuple | None:
    path = os.path.join(art.root, BATCH_FILE)
    if not os.path.isfile(path):
        return None
    from safetensors.torch import load_file
    tensors = load_file(path)
    return tuple(tensors[str(i)] for i in range(len(tensors)))


def open_artifact(root: str) -> Artifact:
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise PlanError(f"{root!r} is not a threefold artifact (no {MANIFEST}); "
                        "make one with `threefold compile SPEC --plan PLAN --out DIR`")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != 1:
        raise PlanError(f"{root!r}: artifact format {manifest.get('format')!r} is not supported (expected 1)")
    return Artifact(os.path.abspath(root), manifest)


def import_file(path: str, name: str | None = None):
    """Import a generated source file as a module (unique name per path)."""
    name = name or "_threefold_gen_" + str(abs(hash(os.path.abspath(path))))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sibling_module(file: str, name: str):
    """The generated module `name`.py next to `file` (how chunk modules find kernels.py)."""
    path = os.path.join(os.path.dirname(os.path.abspath(file)), f"{name}.py")
    return import_file(path, "_threefold_gen_" + str(abs(hash(path))))


def load_chunk(art: Artifact, chunk: int, tp_rank: int = 0, device="cpu",
               weights: bool = True) -> ChunkModule:
    entry = art.chunks[chunk]
    module = import_file(art.module_path(chunk, tp_rank))
    cls = getattr(module, entry["class"])
    mod: ChunkModule = cls(device=device)
    wpath = art.weights_path(chunk, tp_rank) if weights else None
    if wpath:
        from safetensors.torch import load_file
        mod.load_state(load_file(wpath, device=str(torch.device(device))))
    return mod
