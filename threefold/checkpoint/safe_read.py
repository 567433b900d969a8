"""Reading a checkpoint never runs code from it.

Checkpoints are files people download and pass around; the CRC index (files.py) detects
corruption, not tampering. torch.distributed.checkpoint stores two things with pickle, and
plain pickle calls whatever the file names:

- `.metadata` (the whole DCP Metadata object): read here with an unpickler that admits only
  the classes DCP's FileSystemWriter writes (torch 2.13: the dataclasses of
  torch.distributed.checkpoint.metadata, its _StorageInfo, torch.Size, dtypes, the layout
  lookup, pathlib paths) and refuses any other in one line naming the class and the file;
- non-tensor values (`meta`, optimizer param groups, the loss scale, RNG states), which
  DCP's default planner reads with `torch.load(weights_only=False)`: read here with
  `weights_only=True` (tensors, containers, numbers, strings only).

Tensors themselves DCP already reads with `torch.load(weights_only=True)` as raw storage.
`SafeReader` and `SafeLoadPlanner` (or `safe_load_bytes` in a planner of one's own) are the
only way threefold reads a checkpoint.
"""
from __future__ import annotations

import io
import os
import pickle
import re
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from threefold.errors import PlanError

_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},                          # chunk offsets and sizes
    "torch.serialization": {"_get_layout"},     # TensorProperties.layout, by name
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},  # checkpoint_id
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},  # Python 3.13+
}


def _refused(what: str, path: str) -> PlanError:
    return PlanError(f"checkpoint file {path} names {what}, which a threefold checkpoint never holds: "
                     "refused unread (unpickling it could run code the file chose); load only checkpoints "
                     "from a source you trust, or re-save this one where it was made")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module, name):
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)         # dtypes pickle as torch.<name>
        raise _refused(f"{module}.{name}", self.path)

    def persistent_load(self, pid):
        raise _refused(f"a persistent object ({str(pid)[:60]!r})", self.path)


def read_metadata_file(path: str):
    """The DCP Metadata in `path`, through the restricted unpickler."""
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.metadata import Metadata
    with open(path, "rb") as f:
        try:
            md = _MetadataUnpickler(f, path).load()
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(f"checkpoint file {path}: its DCP metadata is unreadable "
                            f"({type(exc).__name__}); the checkpoint is corrupted") from None
    if not isinstance(md, Metadata):
        raise PlanError(f"checkpoint file {path} holds a {type(md).__name__}, not DCP metadata: "
                        "the checkpoint is corrupted")
    return md


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by the restricted unpickler."""

    def read_data(self, plan, planner):
        planner.threefold_dir = os.fspath(self.path)    # so a refusal names the whole path
        return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs):
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.metadata import StorageMeta
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        md = read_metadata_file(path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")       # torch's weights_only message names the global


def safe_torch_load(data, where: str):
    """torch.load(weights_only=True) of `data` (a file object or path); a refused class is a
    one-line PlanError naming it and `where`."""
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL.search(str(exc))
        raise _refused(found.group(1) if found else "an object outside tensors, containers, numbers "
                       "and strings", where) from None


def safe_load_bytes(planner, read_item, value: io.BytesIO) -> None:
    """DCP planner hook: a non-tensor value, read with weights_only=True."""
    where = read_item.dest_index.fqn
    storage = getattr(getattr(planner, "metadata", None), "storage_data", None) or {}
    info = storage.get(read_item.storage_index)
    if info is not None:
        path = os.path.join(getattr(planner, "threefold_dir", ""), info.relative_path)
        where = f"{path} (entry {read_item.dest_index.fqn!r})"
    planner.state_dict[read_item.dest_index.fqn] = safe_torch_load(value, where)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values read with weights_only=True."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    load_bytes = safe_load_bytes




@contextmanager
def unwrapped():
    """DCP wraps what a read raises in a CheckpointException (a BaseException, with every
    rank's traceback in its text): a refusal comes out as the PlanError it is, anything else
    as a RuntimeError with the first rank's one-line cause."""
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except CheckpointException as exc:
        causes = [pair[0] if isinstance(pair, tuple) else pair for pair in exc.failures.values()]
        for cause in causes:
            if isinstance(cause, PlanError):
                raise cause from None
        first = causes[0] if causes else exc
        raise RuntimeError(f"{type(first).__name__}: {str(first).strip().splitlines()[0][:300] if str(first).strip() else ''}") from None
