"""Load a saved artifact's per-rank modules, without the compiler or the model's source.

An artifact directory holds manifest.json, one generated `.py` per chunk (shared by every
tp rank: the rank is its tp group's, at run time), weight shards per (chunk, tp rank),
`kernels.py` when fusion made kernels, as `weights/*.safetensors` keyed by original FQNs
(absent for models compiled on the meta device) and `batch.safetensors`.

Trust model: an artifact is code. Its manifest lists the sha256 of every file; nothing is
imported or read until its bytes match, and the bytes that were checked are the bytes that
are executed or parsed (no second read from disk). Every path must stay inside the
artifact directory (no absolute paths, no `..`, no symbolic links leading out). The
manifest is checked for consistency (mesh against chunks, weights against the modules'
parameter shapes). The hashes prove the files are the ones the manifest names, not who
wrote the manifest: run only artifacts you made or received over a channel you trust.
`trust=True` (`threefold run --trust`) skips the hash comparison, never the path checks.
Who wrote the manifest is checked only with a signature: `compile --sign KEY` and
`run --verify KEY` (runtime/signing.py).
"""
from __future__ import annotations

import hashlib
import linecache
import os
import sys
import types
from dataclasses import dataclass

import torch

from threefold.errors import PlanError
from threefold.runtime.manifest import FORMAT, MANIFEST, Manifest, safe_path  # noqa: F401 (FORMAT: writers)
from threefold.runtime.module import ChunkModule

BATCH_FILE = "batch.safetensors"   # the workload's example global batch, when saved


@dataclass
class Artifact:
    root: str
    manifest: Manifest
    trust: bool = False

    @property
    def plan(self):
        return self.manifest.plan

    @property
    def chunks(self):
        return self.manifest.chunks

    def module_path(self, chunk: int) -> str:
        return safe_path(self.root, self.chunks[chunk].module)

    def weights_path(self, chunk: int, tp_rank: int) -> str | None:
        rel = self.chunks[chunk].weights.get(tp_rank)
        return safe_path(self.root, rel) if rel else None

    def read(self, rel: str) -> bytes:
        """The file's bytes, after checking its path and its sha256 against the manifest."""
        path = safe_path(self.root, rel)
        expected = self.manifest.files.get(rel)
        if expected is None:
            raise PlanError(f"artifact {self.root!r}: {rel} has no sha256 in {MANIFEST}; "
                            "refusing to read an unlisted file (recompile the artifact)")
        # lazy: start-up: regular_file loads only on this path
        from threefold.regular_file import require_regular_file
        require_regular_file(path, f"artifact {self.root!r}: {rel}")   # a FIFO or device never ends
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise PlanError(f"artifact {self.root!r}: {rel} cannot be read ({exc.strerror})") from None
        if not self.trust and hashlib.sha256(data).hexdigest() != expected:
            raise PlanError(f"artifact {self.root!r}: {rel} does not match its sha256 in {MANIFEST} "
                            "(modified or corrupted); recompile the artifact")
        return data

    def verify(self) -> None:
        """Check every listed file now (the parent does this before any rank starts)."""
        for rel in sorted(self.manifest.files):
            self.read(rel)


def open_artifact(root: str, trust: bool = False, verify_key: bytes | None = None) -> Artifact:
    """The artifact at `root`: its manifest read and checked (runtime/manifest.py), no other
    file touched yet. With `verify_key`, the manifest's bytes must carry its signature under
    that key (runtime/signing.py), and the bytes checked are the bytes parsed."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise PlanError(f"{root!r} is not a threefold artifact (no {MANIFEST}); "
                        "make one with `threefold compile SPEC --plan PLAN --out DIR`")
    if os.path.islink(path):
        raise PlanError(f"artifact {root!r}: {MANIFEST} is a symbolic link; refusing it")
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode()
    except (OSError, ValueError) as exc:
        raise PlanError(f"artifact {root!r}: {MANIFEST} cannot be read ({exc}); recompile the artifact") from None
    if verify_key is not None:      # the bytes checked are the bytes parsed
        # lazy: start-up: runtime.signing loads only on this path
        from threefold.runtime.signing import verify
        verify(os.path.abspath(root), data, verify_key)
    return Artifact(os.path.abspath(root), Manifest.loads(text, root), trust)


def load_batch(art: Artifact) -> tuple | None:
    if BATCH_FILE not in art.manifest.files:
        return None
    from safetensors.torch import load   # lazy: safetensors loads only when weight files are read or written
    try:
        tensors = load(art.read(BATCH_FILE))
        return tuple(tensors[str(i)] for i in range(len(tensors)))
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(f"artifact {art.root!r}: {BATCH_FILE} is not a valid batch ({exc})") from None


# Modules made from checked source text, by the path they would have on disk, so that
# `sibling_module` (how chunk modules find kernels.py) finds the checked one.
_BY_PATH: dict[str, types.ModuleType] = {}


def import_source(text: str, path: str) -> types.ModuleType:
    """Execute source text as a module whose __file__ is `path` (no file needs to exist;
    linecache holds the text, so tracebacks and inspect.getsource, which Triton uses, work)."""
    path = os.path.abspath(path) if not path.startswith("<") else path
    name = "_threefold_gen_" + hashlib.sha256((path + "\0" + text).encode()).hexdigest()[:20]
    if name in sys.modules:
        _BY_PATH[path] = sys.modules[name]
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__file__ = path
    linecache.cache[path] = (len(text), None, text.splitlines(True), path)
    sys.modules[name] = module
    _BY_PATH[path] = module
    try:
        exec(compile(text, path, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        _BY_PATH.pop(path, None)
        raise
    return module


def import_file(path: str, name: str | None = None):
    """Import a generated source file from disk (tests and tools; `run` uses checked bytes)."""
    with open(path) as f:
        return import_source(f.read(), path)


def sibling_module(file: str, name: str):
    """The generated module `name`.py next to `file` (how chunk modules find kernels.py):
    the one already loaded from checked text, else the file on disk."""
    base = os.path.dirname(file) if file.startswith("<") else os.path.dirname(os.path.abspath(file))
    path = f"{base}/{name}.py" if file.startswith("<") else os.path.join(base, f"{name}.py")
    if path in _BY_PATH:
        return _BY_PATH[path]
    if file.startswith("<"):
        raise ImportError(f"generated module {name}.py was not loaded before {file}")
    return import_file(path)


def load_chunk(art: Artifact, chunk: int, tp_rank: int = 0, device="cpu",
               weights: bool = True) -> ChunkModule:
    entry = art.chunks[chunk]
    mod: ChunkModule = chunk_class(art, entry)(device=device)
    wrel = entry.weights.get(tp_rank) if weights else None
    if wrel:
        mod.load_state(_load_weights(art, wrel, type(mod), device))
    return mod


def chunk_class(art: Artifact, entry) -> type:
    """The chunk's ChunkModule subclass, imported from its checked source (kernels first,
    and before either the modules that register the custom ops it calls)."""
    if art.manifest.op_modules:
        # lazy: start-up: runtime.op_modules loads only on this path
        from threefold.runtime.op_modules import import_op_modules
        import_op_modules(art.manifest.op_modules, art.root, art.trust)
    if "kernels.py" in art.manifest.files:
        import_source(art.read("kernels.py").decode(), os.path.join(art.root, "kernels.py"))
    rel = entry.module   # one module for every tp rank; the weights are this rank's
    module = import_source(art.read(rel).decode(), safe_path(art.root, rel))
    cls = getattr(module, entry.cls, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, ChunkModule)):
        raise PlanError(f"artifact {art.root!r}: {rel} defines no chunk module {entry.cls!r}")
    return cls


class ArtifactSource:
    """Where `assemble_rank` gets a rank's modules and weights for `threefold run`: the
    artifact's checked sources and its per-(chunk, tp rank) weight shards."""

    def __init__(self, art: Artifact):
        self.art = art

    def chunk_class(self, entry) -> type:
        return chunk_class(self.art, entry)

    def load_weights(self, module: ChunkModule, entry, tp_rank: int, device) -> None:
        rel = entry.weights.get(tp_rank)
        if rel:
            module.load_state(_load_weights(self.art, rel, type(module), device))


def _load_weights(art: Artifact, rel: str, cls, device) -> dict[str, torch.Tensor]:
    """A chunk's weight shard, checked: exactly the module's parameters and buffers, each
    with the shape and dtype the module declares."""
    from safetensors.torch import load   # lazy: safetensors loads only when weight files are read or written
    try:
        tensors = load(art.read(rel))
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(f"artifact {art.root!r}: {rel} is not a valid safetensors file ({exc})") from None
    declared = {**cls.PARAMS, **cls.BUFFERS}
    if set(tensors) != set(declared):
        extra, missing = sorted(set(tensors) - set(declared)), sorted(set(declared) - set(tensors))
        raise PlanError(f"artifact {art.root!r}: {rel} does not match its module "
                        f"(missing {missing[:3]}, unexpected {extra[:3]}); recompile the artifact")
    for fqn, (shape, dtype) in declared.items():
        t = tensors[fqn]
        if list(t.shape) != list(shape) or str(t.dtype).replace("torch.", "") != dtype:
            raise PlanError(f"artifact {art.root!r}: {rel} holds {fqn} as {list(t.shape)} {t.dtype}, "
                            f"the module expects {list(shape)} {dtype}; recompile the artifact")
    dev = torch.device(device)
    return {k: v.to(dev) for k, v in tensors.items()}
