"""Checkpoint directories: naming, the `threefold.json` index, checksums, atomic publishing.

A checkpoint root holds `step_<N>/` directories (each one DCP checkpoint: `.metadata` and
`__<rank>_<i>.distcp` files, plus our `threefold.json` with every file's size and CRC32)
and `latest`, the name of the newest. A save is built in a hidden temporary sibling and
renamed into place only when complete, so a crash leaves the previous checkpoints intact.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import zlib

from threefold.errors import PlanError

INDEX = "threefold.json"
LATEST = "latest"
FORMAT = "threefold-checkpoint"
STEP_DIR = re.compile(r"step_(\d+)")


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def crc32_file(path: str, block: int = 16 * 2**20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return crc


def digests(dirpath: str, names: list[str]) -> dict[str, list[int]]:
    return {n: [os.path.getsize(os.path.join(dirpath, n)), crc32_file(os.path.join(dirpath, n))] for n in names}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_index(dirpath: str, index: dict) -> None:
    path = os.path.join(dirpath, INDEX)
    with open(path, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(dirpath)


def publish(root: str, tmp: str, name: str, keep: int | None, run_id: str | None = None) -> str:
    """Rename the finished `tmp` to root/name, point `latest` at it, drop all but the last
    `keep` checkpoints. An existing root/name is moved aside first and removed last. With
    `run_id` (threefold train's run) only that run's checkpoints are replaced or pruned: a
    step of the same name another run wrote is kept as step_<N>.run-<its id>."""
    final = os.path.join(root, name)
    aside, kept = None, None
    if os.path.exists(final):
        theirs = run_id_of(final)
        if run_id is not None and theirs != run_id:
            kept = os.path.join(root, f"{name}.run-{(theirs or 'unknown')[:12]}")
            os.rename(final, kept)
        else:
            aside = f"{tmp}.replaced"
            os.rename(final, aside)
    os.rename(tmp, final)
    with open(os.path.join(root, LATEST + ".tmp"), "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
    _fsync_dir(root)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    if keep is not None:
        mine = [s for s in list_steps(root) if run_id is None or run_id_of(os.path.join(root, s)) == run_id]
        for old in mine[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def run_id_of(ckpt: str) -> str | None:
    """The run id threefold train recorded in ckpt's index (None: none, or unreadable)."""
    try:
        with open(os.path.join(ckpt, INDEX)) as f:
            run = json.load(f).get("run")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return run.get("id") if isinstance(run, dict) and isinstance(run.get("id"), str) else None


RUN_ASIDE = re.compile(r"step_\d+\.run-[0-9a-z]+")    # another run's step kept aside by publish
PARTIAL = re.compile(r"\.tmp-step_\d+-.+")    # save's temporary directory (save.py), mkdtemp's suffix


def drop_partial(root: str) -> list[str]:
    """Remove what interrupted saves left under root (their temporary directories, never a
    published step_<N>); the names removed. Only call it where no save is running: the
    next save by the same job, or a resume (the CLI holds the directory's lock)."""
    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    for name in names:
        path = os.path.join(root, name)
        if PARTIAL.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path) and not in_progress(path):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(name)
    return gone


def hold_partial(tmp: str) -> int:
    """A flock on the temporary directory a save is filling, held (its fd) until the save is
    published or fails: drop_partial leaves a held one alone (another run's save in progress)."""
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def in_progress(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True         # held by a live save (the kernel drops it when that process dies)
    finally:
        os.close(fd)


def list_steps(root: str) -> list[str]:
    """Complete checkpoints under root (those with an index), oldest first."""
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root)
             if STEP_DIR.fullmatch(d) and os.path.isfile(os.path.join(root, d, INDEX))]
    return sorted(found, key=lambda d: int(STEP_DIR.fullmatch(d).group(1)))


def check_files(ckpt: str, index: dict, rank: int, world: int) -> str | None:
    """The first problem with the files (missing, truncated, corrupted), or None. Every rank
    checks sizes; the CRC of file i is checked by rank i % world (each file read once)."""
    for i, (name, (size, crc)) in enumerate(sorted(index["files"].items())):
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            return f"file {name} is missing (a shard of the checkpoint); the checkpoint is incomplete"
        actual = os.path.getsize(path)
        if actual != size:
            return f"file {name} has {actual} bytes, expected {size}: it is truncated or overwritten"
        if i % world == rank and crc32_file(path) != crc:
            return f"file {name} fails its checksum: it is corrupted"
    return None


def coverage_problem(md) -> str | None:
    """A saved tensor whose chunks do not add up to the whole tensor (partial weights)."""
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            have = sum(math.prod(c.sizes) for c in m.chunks)
            if have != math.prod(m.size):
                return f"{key} holds {have} of its {math.prod(m.size)} elements"
    return None
