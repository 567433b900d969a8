"""A background checkpoint's state staged in /dev/shm, so a rank killed mid-write loses nothing.

An asynchronous save (checkpoint/async_save.py) copies this rank's pieces to host memory
and writes them in the background. Staged in the process's own memory, a kill during that
write loses the step: the job restarts from the checkpoint before, up to two intervals
back. Staged here instead, the copy is a file in /dev/shm (shared memory: it outlives the
process on the same host), so the step survives:

- `Snapshot.stage(sd)` (on the step loop): one file per rank and step, sized once, mapped,
  and every tensor copied into it with one copy each; the state dict handed to the writer
  reads its pieces from that mapping (no second copy). Small values (meta, optimizer groups,
  generator states) are also serialised into the file's tail.
- `Snapshot.seal()` (the writer thread, before the write): the file's CRC32 and a JSON
  header naming every piece, written by rename: a snapshot with a header is complete.
- After the write is published (or fails) the rank drops its snapshot.
- `settle(ckpt_dir)` (whoever restarts the job: `threefold train`'s parent, or under
  torchrun the first restarted process on the host, under a lock): the newest step whose
  snapshot is sealed on every rank of the world that wrote it, if newer than the newest
  published checkpoint, is written as that checkpoint (the same write: DCP, CRC index,
  atomic rename) and read back with the restricted reader; otherwise, or if any check
  fails, the previous checkpoint stays the newest. Every staged file is removed either way.

A staged snapshot is read back with torch.load(weights_only=True) and JSON only, from a
directory of this user's (mode 0700), and its CRC must match before anything is written.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import zlib

import torch

from threefold.checkpoint.layout import Sharded
import copy
import errno

SHM = "/dev/shm"
FORMAT = "threefold-stage"
ALIGN = 64
NAME = re.compile(r"step_(\d+)\.rank_(\d+)\.(bin|json)")


def stage_dir(ckpt_dir: str) -> str | None:
    """This checkpoint directory's staging directory in /dev/shm (None: no /dev/shm here)."""
    if not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)):
        return None
    key = hashlib.sha1(os.path.realpath(os.path.abspath(ckpt_dir)).encode()).hexdigest()[:16]
    return os.path.join(SHM, f"threefold-stage-{os.getuid()}-{key}")


def _names(step: int, rank: int) -> tuple[str, str]:
    return f"step_{step:09d}.rank_{rank}.bin", f"step_{step:09d}.rank_{rank}.json"


class ShmPieces(Sharded):
    """A value's pieces (offsets -> tensor, viewing the staged file) with the write items of
    the value they were copied from: DCP writes it as it would have written the live one."""

    def __init__(self, full_shape, dtype: torch.dtype, pieces: dict[tuple, tuple[torch.Tensor, list[int]]]):
        self.full_shape = torch.Size(full_shape)
        self.dim, self.parts = 0, []
        self._dtype = dtype
        self._pieces = pieces           # offsets -> (tensor, chunk sizes)
        self.local = next(iter(pieces.values()))[0] if pieces else torch.empty(0, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def piece_at(self, offsets) -> torch.Tensor:
        return self._pieces[tuple(offsets)][0]

    def __create_write_items__(self, fqn: str, obj):
        # lazy: start-up: torch.distributed.checkpoint.metadata loads only when this runs
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        # lazy: start-up: torch.distributed.checkpoint.planner loads only when this runs
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offs)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)),
                              properties=TensorProperties(dtype=self._dtype), size=self.full_shape))
                for offs, (_, sizes) in self._pieces.items()]

    def __create_chunk_list__(self):
        # lazy: start-up: torch.distributed.checkpoint.metadata loads only when this runs
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, (_, s) in self._pieces.items()]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Snapshot:
    """This rank's staged state of one step (see the module's text)."""

    def __init__(self, directory: str, step: int, rank: int, world: int):
        self.directory, self.step, self.rank, self.world = directory, step, rank, world
        bin_name, json_name = _names(step, rank)
        self.data_path = os.path.join(directory, bin_name)
        self.header_path = os.path.join(directory, json_name)
        self.header: dict = {}
        self.buffer: torch.Tensor | None = None

    def stage(self, sd: dict, fields: dict | None, keep: int | None) -> dict:
        """Copy `sd` into this snapshot's file; the state dict the writer writes (its
        tensors view the file). Raises OSError when /dev/shm cannot take it."""
        plan, objects, at = [], {}, 0
        for key, value in sd.items():
            if isinstance(value, Sharded):     # its regions are its write items' chunks (layout.py)
                pieces = []
                for offs, sizes, view in value.regions():
                    pieces.append((tuple(offs), list(sizes), view, at))
                    at += _align(view.numel() * view.element_size())
                plan.append(("sharded", key, value, pieces))
            elif isinstance(value, torch.Tensor):
                plan.append(("tensor", key, value, at))
                at += _align(value.numel() * value.element_size())
            else:
                objects[key] = value
        blob = io.BytesIO()
        torch.save(objects, blob)
        blob_at, blob_bytes = at, blob.getvalue()
        size = max(1, at + len(blob_bytes))
        for attempt in range(3):     # another rank's drop may remove the empty directory meanwhile
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            try:
                fd = os.open(self.data_path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            _reserve(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(self.data_path)
            raise
        os.close(fd)
        buf = torch.from_file(self.data_path, shared=True, size=size, dtype=torch.uint8)
        self.buffer = buf
        out, entries = {}, []
        for kind, key, value, where in plan:
            if kind == "sharded":      # write items made by the writer, not here (ShmPieces)
                staged_pieces, described = {}, []
                for offs, sizes, view, a in where:
                    dest = _view(buf, a, view.dtype, view.shape)
                    dest.copy_(view.detach())
                    staged_pieces[offs] = (dest, sizes)
                    described.append({"offsets": list(offs), "sizes": sizes, "shape": list(view.shape), "at": a})
                out[key] = ShmPieces(value.full_shape, value.dtype, staged_pieces)
                entries.append({"key": key, "kind": "sharded", "full_shape": list(value.full_shape),
                                "dtype": _dtype_name(value.dtype), "pieces": described})
            else:
                dest = _view(buf, where, value.dtype, value.shape)
                dest.copy_(value.detach())
                out[key] = dest
                entries.append({"key": key, "kind": "tensor", "dtype": _dtype_name(value.dtype),
                                "shape": list(value.shape), "at": where})
        buf[blob_at:blob_at + len(blob_bytes)].copy_(torch.frombuffer(bytearray(blob_bytes), dtype=torch.uint8))
        for key, value in objects.items():
            out[key] = copy.deepcopy(value)
        self.header = {"format": FORMAT, "version": 1, "step": self.step, "rank": self.rank, "world": self.world,
                       "size": size, "entries": entries, "objects": [blob_at, len(blob_bytes)],
                       "fields": fields if self.rank == 0 else None, "keep": keep}
        return out

    def seal(self) -> None:
        """Checksum the staged file and write its header: from now on the snapshot is complete."""
        self.header["crc"] = zlib.crc32(self.buffer.numpy())    # zlib lets go of the GIL
        tmp = self.header_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.header, f)
        os.replace(tmp, self.header_path)

    def drop(self) -> None:
        self.buffer = None
        for path in (self.header_path, self.header_path + ".tmp", self.data_path):
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(self.directory)     # the last rank's drop leaves nothing in /dev/shm
        except OSError:
            pass


def _reserve(fd: int, size: int) -> None:
    """Give the file its pages now: /dev/shm too full is an OSError here (the caller stages
    in memory instead), never a SIGBUS when the copy touches a page tmpfs cannot supply."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    st = os.fstatvfs(fd)             # no fallocate here: at least check the free space
    if st.f_bavail * st.f_frsize < size:
        raise OSError(errno.ENOSPC, f"{size} bytes do not fit in {SHM}")
    os.ftruncate(fd, size)


def _view(buf: torch.Tensor, at: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return buf[at:at + nbytes].view(dtype).view(tuple(shape))


# -- after a failure: commit the newest complete snapshot, drop the rest ---------------------------

def _sealed(directory: str) -> dict[int, dict[int, dict]]:
    """step -> rank -> header, of every sealed snapshot (headers that do not parse are skipped)."""
    out: dict[int, dict[int, dict]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        m = NAME.fullmatch(name)
        if not m or m.group(3) != "json":
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                header = json.load(f)
        except (OSError, ValueError):
            continue
        if (isinstance(header, dict) and header.get("format") == FORMAT and header.get("step") == int(m.group(1))
                and header.get("rank") == int(m.group(2))):
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = header
    return out


def complete_step(directory: str) -> tuple[int, dict[int, dict]] | None:
    """The newest step sealed on every rank of the world that staged it, with its headers."""
    for step, headers in sorted(_sealed(directory).items(), reverse=True):
        worlds = {h.get("world") for h in headers.values()}
        if len(worlds) == 1 and isinstance(w := worlds.pop(), int) and set(headers) == set(range(w)):
            return step, headers
    return None


def _load_rank(directory: str, header: dict) -> dict:
    """One rank's staged state dict, its CRC checked first (ValueError when it does not match)."""
    # lazy: start-up: threefold.checkpoint.safe_read loads 2 more modules only when this runs
    from threefold.checkpoint.safe_read import safe_torch_load
    path = os.path.join(directory, _names(header["step"], header["rank"])[0])
    size = os.path.getsize(path)
    if size != header["size"]:
        raise ValueError(f"{path} has {size} bytes, its header says {header['size']}")
    buf = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    if zlib.crc32(buf.numpy()) != header["crc"]:
        raise ValueError(f"{path} fails its checksum")
    sd = {}
    for e in header["entries"]:
        dtype = _dtype_of(e["dtype"])
        if e["kind"] == "sharded":
            sd[e["key"]] = (e["full_shape"], dtype, {tuple(p["offsets"]): (_view(buf, p["at"], dtype, p["shape"]),
                                                                            p["sizes"]) for p in e["pieces"]})
        else:
            sd[e["key"]] = _view(buf, e["at"], dtype, e["shape"])
    at, n = header["objects"]
    objects = safe_torch_load(io.BytesIO(buf[at:at + n].numpy().tobytes()), path)
    sd.update(objects if isinstance(objects, dict) else {})
    return sd


def merged(directory: str, headers: dict[int, dict]) -> dict:
    """The state dict of every rank's snapshot of one step, as one process writes it: each
    piece once (replicas hold equal copies), each rank's own values (rng.rank<r>) kept."""
    out: dict = {}
    for rank in sorted(headers):
        for key, value in _load_rank(directory, headers[rank]).items():
            if isinstance(value, tuple):
                full_shape, dtype, pieces = value
                if key not in out:
                    out[key] = ShmPieces(full_shape, dtype, {})
                for offs, piece in pieces.items():
                    out[key]._pieces.setdefault(offs, piece)
                if out[key].local.numel() == 0 and out[key]._pieces:
                    out[key].local = next(iter(out[key]._pieces.values()))[0]
            else:
                out.setdefault(key, value)
    return out


def settle(ckpt_dir: str, quiet: bool = False) -> str | None:
    """After ranks failed: commit the newest snapshot sealed on every rank if it is newer than
    the newest checkpoint (its path), and remove every staged file. None: nothing committed."""
    directory = stage_dir(ckpt_dir)
    if directory is None or not os.path.isdir(directory):
        return None
    committed = None
    try:
        found = complete_step(directory)
        if found is not None and found[0] > _newest_step(ckpt_dir):
            committed = _commit(ckpt_dir, directory, *found)
    except Exception as exc:    # the previous checkpoint stays the newest: say why, go on
        if not quiet:
            print(f"threefold: the staged checkpoint could not be committed ({type(exc).__name__}: "
                  f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}); using the previous one",
                  file=sys.stderr)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return committed


def drop_all(ckpt_dir: str) -> None:
    """Remove this checkpoint directory's staged files (a run's end, or before it starts)."""
    directory = stage_dir(ckpt_dir)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _newest_step(ckpt_dir: str) -> int:
    # lazy: start-up: threefold.checkpoint.files loads 2 more modules only when this runs
    from threefold.checkpoint.files import STEP_DIR, list_steps
    steps = list_steps(ckpt_dir)
    return int(STEP_DIR.fullmatch(steps[-1]).group(1)) if steps else -1


def _commit(ckpt_dir: str, directory: str, step: int, headers: dict[int, dict]) -> str:
    """Write the snapshot of `step` as checkpoint ckpt_dir/step_<N> (one process, the same
    atomic write), then read it back with the restricted reader; a checkpoint that fails the
    read is removed and `latest` points back at the previous one."""
    # lazy: start-up: threefold.checkpoint.files loads 2 more modules only when this runs
    from threefold.checkpoint import files
    # lazy: start-up: threefold.checkpoint.reader loads 4 more modules only when this runs
    from threefold.checkpoint.reader import read_checkpoint
    # lazy: start-up: threefold.checkpoint.save loads 7 more modules only when this runs
    from threefold.checkpoint.save import write_checkpoint
    head = headers[0]
    fields = dict(head.get("fields") or {})
    if fields.get("step") != step:
        raise ValueError(f"rank 0's header names step {fields.get('step')}, not {step}")
    fields["world"] = head["world"]     # the world that trained it: same-world resumes restore each rank's rng
    sd = merged(directory, headers)
    path = write_checkpoint(sd, fields, ckpt_dir, step, head.get("keep"))
    try:
        checked = read_checkpoint(path)
        problem = files.check_files(checked.path, checked.index, 0, 1)
        if problem:
            raise ValueError(problem)
    except Exception:
        shutil.rmtree(path, ignore_errors=True)
        steps = files.list_steps(ckpt_dir)
        if steps:
            with open(os.path.join(ckpt_dir, files.LATEST + ".tmp"), "w") as f:
                f.write(steps[-1] + "\n")
            os.replace(os.path.join(ckpt_dir, files.LATEST + ".tmp"), os.path.join(ckpt_dir, files.LATEST))
        raise
    return path
