"""Set-up shared by the paths that move bytes through /dev/shm between ranks of one host
(runtime/local_reduce.py: the data-parallel sum; runtime/local_p2p.py: pipeline messages).

Both agree on everything collectively, over every rank of the job, so that either every
rank uses shared memory or every rank uses gloo: rank 0 draws a token that names the job's
files, one rank creates each file (its pages reserved at once: a full tmpfs is ENOSPC here,
not SIGBUS at a later write), the others map it only if it exists (on another host it does
not, and torch.from_file would create a fresh, unshared file), and the creator unlinks the
name once every rank has it open, so nothing is left in /dev/shm when the job ends or dies.
"""
from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist

from threefold.runtime import comm


def job_token() -> str:
    """A name every rank shares (collective): rank 0's random token."""
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return token[0]


def create(path: str, nbytes: int) -> bool:
    """Create `path` (which must not exist) with `nbytes` reserved; False (and no file) on
    any OSError (no /dev/shm, a full tmpfs, a name already taken)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        finally:
            os.close(fd)
    except OSError:
        unlink(path)
        return False
    return True


def map_existing(path: str, count: int, dtype: torch.dtype) -> torch.Tensor | None:
    """`count` elements of `dtype` shared with every process that maps `path`, or None where
    the file is not there (another host) or cannot be mapped."""
    if not os.path.exists(path):
        return None
    try:
        return torch.from_file(path, shared=True, size=count, dtype=dtype)
    except (OSError, RuntimeError):
        return None


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def agree(ok: bool, what: str = "shared-memory set-up") -> bool:
    """True only if `ok` on every rank (a MIN all-reduce over the job: collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    comm.all_reduce(flag, None, what, op=dist.ReduceOp.MIN)
    return bool(flag.item())
