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
"""
from __future__ import annotations

import hashlib
import json
import linecache
import os
import sys
import types
from dataclasses import dataclass

import torch

from threefold.errors import PlanError
from threefold.runtime.mesh import stage_of
from threefold.runtime.module import ChunkModule

MANIFEST = "manifest.json"
BATCH_FILE = "batch.safetensors"   # the workload's example global batch, when saved
FORMAT = 3                         # 3: one module per chunk ("module"), shared by its tp ranks
MAX_RANKS = 1 << 16                # a mesh beyond this is a corrupt manifest, not a job


@dataclass
class Artifact:
    root: str
    manifest: dict
    trust: bool = False

    @property
    def plan(self) -> str:
        return self.manifest["plan"]

    @property
    def chunks(self) -> list[dict]:
        return self.manifest["chunks"]

    def module_path(self, chunk: int) -> str:
        return safe_path(self.root, self.chunks[chunk]["module"])

    def weights_path(self, chunk: int, tp_rank: int) -> str | None:
        rel = self.chunks[chunk].get("weights", {}).get(str(tp_rank))
        return safe_path(self.root, rel) if rel else None

    def read(self, rel: str) -> bytes:
        """The file's bytes, after checking its path and its sha256 against the manifest."""
        path = safe_path(self.root, rel)
        expected = self.manifest["files"].get(rel)
        if expected is None:
            raise PlanError(f"artifact {self.root!r}: {rel} has no sha256 in {MANIFEST}; "
                            "refusing to read an unlisted file (recompile the artifact)")
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
        for rel in sorted(self.manifest["files"]):
            self.read(rel)


def safe_path(root: str, rel) -> str:
    """root/rel, refusing anything that leaves root (absolute, '..', links pointing out)."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise PlanError(f"artifact {root!r}: file entry {rel!r} in {MANIFEST} is not a relative path")
    parts = rel.replace("\\", "/").split("/")
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts or (len(rel) > 1 and rel[1] == ":"):
        raise PlanError(f"artifact {root!r}: {rel} in {MANIFEST} points outside the artifact directory")
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real_root, path]) != real_root:
        raise PlanError(f"artifact {root!r}: {rel} leads outside the artifact directory (symbolic link?)")
    return path


def _is_count(v, low: int = 1, high: int = MAX_RANKS) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def check_manifest(root: str, m) -> None:
    """Structure and consistency of a manifest, before anything it names is touched."""
    def bad(what: str):
        raise PlanError(f"artifact {root!r}: {MANIFEST} is inconsistent: {what}; recompile the artifact")
    if not isinstance(m, dict):
        bad("it is not a JSON object")
    if m.get("format") != FORMAT:
        raise PlanError(f"{root!r}: artifact format {m.get('format')!r} is not supported (expected {FORMAT}; "
                        "older formats had no weight hashes or one module per tp rank): recompile it with `threefold compile`")
    mesh, chunks, files = m.get("mesh"), m.get("chunks"), m.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) and len(v) == 64 for v in files.values()):
        bad("'files' must map each file to its sha256")
    for rel in files:
        safe_path(root, rel)
    if not isinstance(mesh, dict) or set(mesh) != {"tp", "dp", "pp"} or not all(_is_count(v) for v in mesh.values()):
        bad(f"mesh {mesh!r} must have positive integers tp, dp, pp")
    if mesh["tp"] * mesh["dp"] * mesh["pp"] > MAX_RANKS:
        bad(f"mesh {mesh} asks for more than {MAX_RANKS} ranks")
    sched = m.get("schedule")
    if (not isinstance(sched, dict) or not _is_count(sched.get("microbatches"), 1, 1 << 20)
            or not _is_count(sched.get("interleave"), 1, 1024) or not isinstance(sched.get("kind"), str)):
        bad(f"schedule {sched!r} needs kind, microbatches and interleave")
    if not isinstance(chunks, list) or len(chunks) != mesh["pp"] * sched["interleave"] or m.get("num_chunks") != len(chunks):
        bad(f"{len(chunks) if isinstance(chunks, list) else chunks!r} chunks for pp={mesh['pp']} "
            f"v={sched['interleave']} (num_chunks {m.get('num_chunks')!r})")
    tp_ranks = {str(r) for r in range(mesh["tp"])}
    with_weights = None
    for i, c in enumerate(chunks):
        if not isinstance(c, dict) or c.get("index") != i or c.get("stage") != stage_of(i, mesh["pp"]):
            bad(f"chunk {i} must have index {i} and stage {stage_of(i, mesh['pp'])}")
        if not isinstance(c.get("class"), str) or not c["class"].isidentifier():
            bad(f"chunk {i} class {c.get('class')!r} is not a name")
        weights = c.get("weights", {})
        if not isinstance(weights, dict) or (weights and set(weights) != tp_ranks):
            bad(f"chunk {i} weights must name one file per tp rank 0..{mesh['tp'] - 1}")
        if not c.get("module"):
            bad(f"chunk {i} has no module")
        for key, rel in [("module", c["module"])] + [("weights", w) for w in weights.values()]:
            safe_path(root, rel)
            if rel not in files:
                bad(f"chunk {i} {key} file {rel!r} has no sha256 in 'files'")
        has = bool(c.get("weights"))
        if with_weights is not None and has != with_weights:
            bad("some chunks have weights and others do not")
        with_weights = has


def open_artifact(root: str, trust: bool = False) -> Artifact:
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise PlanError(f"{root!r} is not a threefold artifact (no {MANIFEST}); "
                        "make one with `threefold compile SPEC --plan PLAN --out DIR`")
    if os.path.islink(path):
        raise PlanError(f"artifact {root!r}: {MANIFEST} is a symbolic link; refusing it")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise PlanError(f"artifact {root!r}: {MANIFEST} is not valid JSON ({exc}); recompile the artifact") from None
    check_manifest(root, manifest)
    return Artifact(os.path.abspath(root), manifest, trust)


def load_batch(art: Artifact) -> tuple | None:
    if BATCH_FILE not in art.manifest["files"]:
        return None
    from safetensors.torch import load
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
    if "kernels.py" in art.manifest["files"]:
        import_source(art.read("kernels.py").decode(), os.path.join(art.root, "kernels.py"))
    rel = entry["module"]   # one module for every tp rank; the weights are this rank's
    module = import_source(art.read(rel).decode(), safe_path(art.root, rel))
    cls = getattr(module, entry["class"], None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, ChunkModule)):
        raise PlanError(f"artifact {art.root!r}: {rel} defines no chunk module {entry['class']!r}")
    mod: ChunkModule = cls(device=device)
    wrel = entry.get("weights", {}).get(str(tp_rank)) if weights else None
    if wrel:
        mod.load_state(_load_weights(art, wrel, cls, device))
    return mod


def _load_weights(art: Artifact, rel: str, cls, device) -> dict[str, torch.Tensor]:
    """A chunk's weight shard, checked: exactly the module's parameters and buffers, each
    with the shape and dtype the module declares."""
    from safetensors.torch import load
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
