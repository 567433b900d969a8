"""The one reader of a checkpoint's metadata: every field checked before anything is used.

A checkpoint folder is data someone may have edited. Before a tensor is allocated, a model
is built or a rank starts, `read_checkpoint` checks, in order and in bounded time:

- `latest` (in a root): a regular file of at most 256 bytes naming a `step_<N>` that exists;
- `threefold.json`: a regular file (never a FIFO or device: those are refused by what the
  path is, before it is opened) of bounded size, whose fields have the schema's types and
  ranges (INDEX_SCHEMA), whose file names are plain names inside the folder, each of them a
  regular file (no link) of exactly its recorded size;
- `.metadata` (DCP's, through the restricted unpickler of safe_read.py): every tensor's
  shape, dtype and chunks, every storage entry's file (one the index lists, so the CRCs
  cover every file that is read) and byte range inside that file's real size, and each
  chunk's bytes within its entry: a recorded size of 2**40 cannot be allocated;
- `meta` (step, extra; read with weights_only=True): its schema (META_SCHEMA), its step the
  index's and the folder's.

A violation is a PlanError of one line naming the file and the field. CRCs are checked by
the callers that read the tensors (files.check_files), on the files the index lists.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field

import torch

from threefold.checkpoint import files
from threefold.checkpoint.safe_read import SafeLoadPlanner, SafeReader, read_metadata_file, unwrapped
from threefold.errors import PlanError

MAX_INDEX_BYTES = 256 * 2**20     # threefold.json: shapes and names of a very large model fit
MAX_LATEST_BYTES = 256
MAX_STEP = 10**12
MAX_WORLD = 2**20
MAX_DIMS = 64


@dataclass
class Checkpoint:
    path: str                       # the step directory
    index: dict                     # threefold.json, checked
    metadata: object = None         # DCP Metadata, checked
    meta: dict = field(default_factory=dict)   # the `meta` entry, checked (when read)

    @property
    def extra(self) -> dict:
        return self.meta.get("extra") or {}

    @property
    def generate(self) -> dict:
        return self.extra.get("generate") or {}

    def sizes(self) -> dict[str, int]:
        return {name: v[0] for name, v in self.index["files"].items()}


def damaged(path: str, what: str, why: str) -> PlanError:
    return PlanError(f"checkpoint file {path}: {what} {why}; the checkpoint is damaged or was edited, "
                     "load an earlier one (or re-save it where it was made)")


# -- the folder and its files ------------------------------------------------------------------

def _lstat_regular(path: str, what: str, owner: str):
    """os.lstat of a regular file (not a link, FIFO, device, socket or directory), else a PlanError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise damaged(owner, what, f"names {os.path.basename(path)}, which is missing (the checkpoint is "
                      "incomplete)") from None
    except OSError as exc:
        raise damaged(owner, what, f"names {path}, which cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        from threefold.regular_file import kind_of   # lazy: start-up: regular_file loads only on this path
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else kind_of(st.st_mode)
        raise damaged(owner, what, f"names {path}, which is {kind}, not a regular file")
    return st


def _read_small(path: str, limit: int, what: str) -> bytes:
    st = _lstat_regular(path, what, path)
    if st.st_size > limit:
        raise damaged(path, what, f"is {st.st_size} bytes, more than the {limit} a checkpoint writes")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read(limit + 1)
    except OSError as exc:
        raise damaged(path, what, f"cannot be read ({exc.strerror or exc})") from None


def resolve(path: str) -> str:
    """The step directory `path` names: itself, `latest` in a root, or (no `latest`) the newest.
    A `latest` that is not a small regular file naming a complete step is refused (dangling)."""
    if os.path.lexists(os.path.join(path, files.INDEX)):     # what it is is checked when it is read
        return path
    if not os.path.exists(path):
        raise PlanError(f"checkpoint {path} does not exist: pass a directory written by threefold.save")
    if not os.path.isdir(path):
        raise PlanError(f"checkpoint {path} is a file, not a checkpoint directory written by threefold.save")
    latest = os.path.join(path, files.LATEST)
    if os.path.lexists(latest):
        raw = _read_small(latest, MAX_LATEST_BYTES, "latest")
        name = raw.decode("ascii", "replace").strip()
        if not (name.isascii() and files.STEP_DIR.fullmatch(name)):
            raise damaged(latest, "latest", f"holds {name[:40]!r}, not a step_<N> name")
        if not os.path.isfile(os.path.join(path, name, files.INDEX)):
            raise PlanError(f"checkpoint {path}: latest names {name}, which is not a complete checkpoint "
                            "(dangling): pass a step directory explicitly, or fix latest")
        return os.path.join(path, name)
    steps = files.list_steps(path)
    if steps:
        return os.path.join(path, steps[-1])
    raise PlanError(f"{path} is not a threefold checkpoint (no {files.INDEX}, no step_* checkpoints in it): "
                    "pass a directory written by threefold.save")


# -- threefold.json ----------------------------------------------------------------------------

def _int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _plain_name(name) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and name != files.INDEX)


def check_index(ckpt: str, index) -> dict:
    where = os.path.join(ckpt, files.INDEX)

    def need(ok: bool, what: str, why: str) -> None:
        if not ok:
            raise damaged(where, f"field {what!r}", why)

    need(isinstance(index, dict), "(top level)", "is not a JSON object")
    if index.get("format") != files.FORMAT:
        raise PlanError(f"checkpoint {ckpt}: {files.INDEX} is not a threefold checkpoint index; "
                        "pass a directory written by threefold.save")
    need(_int(index.get("version", 1), 1, 1), "version", "is not 1 (the only version this threefold reads)")
    fs = index.get("files")
    need(isinstance(fs, dict) and len(fs) > 0, "files", "is not an object of file -> [size, crc32]")
    need(".metadata" in fs, "files", "does not list .metadata")
    for name, v in fs.items():
        need(_plain_name(name), f"files.{str(name)[:40]}", "is not a plain file name inside the folder")
        need(isinstance(v, list) and len(v) == 2 and _int(v[0], 0, 2**62) and _int(v[1], 0, 2**32 - 1),
             f"files.{name}", "is not [size, crc32] (two non-negative integers)")
    need(_int(index.get("step"), 0, MAX_STEP), "step", f"is not an integer 0..{MAX_STEP}")
    need(_int(index.get("world"), 1, MAX_WORLD), "world", f"is not an integer 1..{MAX_WORLD}")
    need(isinstance(index.get("plan"), str) and len(index["plan"]) < 4096, "plan", "is not a plan string")
    shapes = index.get("state_shapes", {})
    need(isinstance(shapes, dict), "state_shapes", "is not an object")
    for k, v in shapes.items():
        need(isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and len(v[0]) <= MAX_DIMS
             and all(_int(d, 0, 2**62) for d in v[0]) and isinstance(v[1], str),
             f"state_shapes.{k[:60]}", "is not [[dims...], dtype]")
    bufs = index.get("buffers", [])
    need(isinstance(bufs, list) and all(isinstance(b, str) for b in bufs), "buffers", "is not a list of names")
    need(isinstance(index.get("has_optimizer", False), bool), "has_optimizer", "is not true or false")
    run = index.get("run")
    need(run is None or (isinstance(run, dict) and all(isinstance(k, str) for k in run)), "run", "is not an object")
    name = os.path.basename(os.path.normpath(ckpt))
    if files.STEP_DIR.fullmatch(name):
        need(int(files.STEP_DIR.fullmatch(name).group(1)) == index["step"], "step",
             f"is {index['step']}, not the step of its folder {name}")
    return index


def read_index(ckpt: str) -> dict:
    path = os.path.join(ckpt, files.INDEX)
    raw = _read_small(path, MAX_INDEX_BYTES, files.INDEX)
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise PlanError(f"checkpoint {ckpt}: {files.INDEX} is unreadable ({type(exc).__name__}); "
                        "the checkpoint is corrupted, load an earlier one") from None
    return check_index(ckpt, index)


def check_listed_files(ckpt: str, index: dict) -> None:
    """Every listed file a regular file (no link) of its recorded size."""
    owner = os.path.join(ckpt, files.INDEX)
    for name, (size, _) in sorted(index["files"].items()):
        path = os.path.join(ckpt, name)
        st = _lstat_regular(path, f"field 'files.{name}'", owner)
        if st.st_size != size:
            raise PlanError(f"checkpoint {ckpt}: file {name} has {st.st_size} bytes, expected {size}: it is "
                            "truncated or overwritten; load an earlier checkpoint")


# -- DCP's .metadata ----------------------------------------------------------------------------

def _dims(v) -> bool:
    return isinstance(v, (torch.Size, tuple, list)) and len(v) <= MAX_DIMS and all(_int(d, 0, 2**62) for d in v)


def check_metadata(ckpt: str, md, sizes: dict[str, int]) -> None:
    """Types, shapes and byte ranges of DCP's metadata, bounded by the files' real sizes."""
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)
    where = os.path.join(ckpt, ".metadata")
    sdm, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(sdm, dict):
        raise damaged(where, "state_dict_metadata", "is not a dict")
    if not isinstance(storage, dict):
        raise damaged(where, "storage_data", "is not a dict")
    lengths: dict[tuple, int] = {}
    for key, info in storage.items():
        what = f"storage entry {str(getattr(key, 'fqn', key))[:80]!r}"
        if not (isinstance(key, MetadataIndex) and isinstance(key.fqn, str) and isinstance(info, _StorageInfo)):
            raise damaged(where, what, "is not a DCP storage record")
        rel = info.relative_path
        if not isinstance(rel, str) or rel not in sizes:
            raise damaged(where, what, f"names file {str(rel)[:80]!r}, which {files.INDEX} does not list "
                          "(a path outside the folder, or a file without a checksum)")
        if not (_int(info.offset, 0, 2**62) and _int(info.length, 0, 2**62)) or \
                info.offset + info.length > sizes[rel]:
            raise damaged(where, what, f"reads bytes {info.offset}..{info.offset}+{info.length} of {rel}, "
                          f"which has {sizes[rel]}")
        lengths[(key.fqn, tuple(key.offset) if key.offset is not None else None)] = info.length
    for fqn, m in sdm.items():
        what = f"entry {str(fqn)[:80]!r}"
        if not isinstance(fqn, str):
            raise damaged(where, what, "is not named by a string")
        if isinstance(m, BytesStorageMetadata):
            if (fqn, None) not in lengths:
                raise damaged(where, what, "has no storage record")
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise damaged(where, what, f"is a {type(m).__name__}, not a tensor or bytes record")
        dtype = getattr(m.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not _dims(m.size) or not isinstance(m.chunks, list):
            raise damaged(where, what, "has no valid dtype, size or chunk list")
        item = torch.empty((), dtype=dtype).element_size()
        for c in m.chunks:
            if not (isinstance(c, ChunkStorageMetadata) and _dims(c.offsets) and _dims(c.sizes)
                    and len(c.offsets) == len(c.sizes) == len(m.size)
                    and all(o + s <= n for o, s, n in zip(c.offsets, c.sizes, m.size))):
                raise damaged(where, what, f"has a chunk outside its size {list(m.size)}")
            length = lengths.get((fqn, tuple(c.offsets)))
            if length is None:
                raise damaged(where, what, f"chunk at {list(c.offsets)} has no storage record")
            if math.prod(c.sizes) * item > length:
                raise damaged(where, what, f"chunk of {list(c.sizes)} {dtype} is more than the {length} bytes "
                              "stored for it")


# -- the meta entry -----------------------------------------------------------------------------

def _number(v) -> bool:
    return type(v) in (int, float)


def check_meta(ckpt: str, meta, index: dict | None = None, md=None, strict: bool = True) -> dict:
    """`meta` checked against its schema; with `md`, the recorded GPT config against the
    saved tensors' shapes. `strict=False` (threefold.load of a user's own checkpoint): an
    `extra` that is not a dict is the user's value, returned as saved."""
    # lazy: start-up: checkpoint.run_record loads only on this path
    from threefold.checkpoint.run_record import check_generate, gpt_config
    where = f"{os.path.join(ckpt, '.metadata')} (entry 'meta')"

    def need(ok: bool, what: str, why: str) -> None:
        if not ok:
            raise damaged(where, f"field {what!r}", why)

    if meta is None:
        return {}
    need(isinstance(meta, dict), "meta", f"is a {type(meta).__name__}, not a dict")
    need(_int(meta.get("step"), 0, MAX_STEP), "step", f"is not an integer 0..{MAX_STEP}")
    if index is not None:
        need(meta["step"] == index["step"], "step", f"is {meta['step']}, not the index's {index['step']}")
    for k in ("engine_step", "rng_base"):
        need(k not in meta or _int(meta[k], 0, 2**63 - 1), k, "is not a non-negative integer")
    extra = meta.get("extra")
    if extra is None or (not strict and not isinstance(extra, dict)):
        return meta
    need(isinstance(extra, dict), "extra", f"is a {type(extra).__name__}, not a dict")
    for k in ("losses", "seconds"):
        v = extra.get(k, [])
        need(isinstance(v, list) and all(_number(x) for x in v), f"extra.{k}", "is not a list of numbers")
    for k in ("skipped", "rows"):
        v = extra.get(k, [])
        need(isinstance(v, list) and all(isinstance(x, dict) for x in v), f"extra.{k}", "is not a list of records")
    need(extra.get("initial_val_loss") is None or _number(extra["initial_val_loss"]), "extra.initial_val_loss",
         "is not a number")
    need(extra.get("data") is None or isinstance(extra["data"], dict), "extra.data", "is not a dict")
    need(extra.get("run") is None or isinstance(extra["run"], dict), "extra.run", "is not a dict")
    gen = extra.get("generate")
    if gen is not None:
        problem = check_generate(gen)
        if problem:
            need(False, f"extra.generate.{problem[0]}", problem[1])
        if "gpt" in gen and md is not None:
            shapes = {k[len("model."):]: tuple(m.size) for k, m in md.state_dict_metadata.items()
                      if k.startswith("model.") and hasattr(m, "size")}
            gpt_config(gen["gpt"], shapes, ckpt)
    return meta


def read_meta(ckpt: str, md) -> dict:
    """The `meta` entry alone (DCP, weights_only=True), bounded by its storage record's length."""
    import torch.distributed.checkpoint as dcp   # lazy: DCP loads only when a checkpoint is saved or loaded
    # lazy: start-up: checkpoint.collective loads only on this path
    from threefold.checkpoint.collective import quiet
    from threefold.checkpoint.state import META   # lazy: start-up: checkpoint.state loads only on this path
    if META not in md.state_dict_metadata:
        return {}
    sd = {META: None}
    try:
        with quiet(1), unwrapped():
            dcp.load(sd, storage_reader=CheckedReader(ckpt, md), planner=SafeLoadPlanner(), no_dist=True)
    except PlanError:
        raise
    except Exception as exc:
        raise damaged(os.path.join(ckpt, ".metadata"), "entry 'meta'",
                      f"cannot be read ({str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})") from None
    return sd.get(META)


class CheckedReader(SafeReader):
    """A SafeReader that hands out the metadata already read and checked."""

    def __init__(self, path, md):
        super().__init__(path)
        self._md = md

    def read_metadata(self, *args, **kwargs):
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(self._md, "storage_meta", None) is None:
            self._md.storage_meta = StorageMeta()
        self._md.storage_meta.load_id = self.load_id
        return self._md


def read_checkpoint(path: str, meta: bool = True) -> Checkpoint:
    """The checked index, DCP metadata and (with `meta`) meta entry of the checkpoint at
    `path` (a step directory, or a root: `latest`, else its newest)."""
    ckpt = resolve(path)
    index = read_index(ckpt)
    check_listed_files(ckpt, index)
    md = read_metadata_file(os.path.join(ckpt, ".metadata"))
    check_metadata(ckpt, md, Checkpoint(ckpt, index).sizes())
    out = Checkpoint(ckpt, index, md)
    if meta:
        out.meta = check_meta(ckpt, read_meta(ckpt, md), index, md)
    return out
