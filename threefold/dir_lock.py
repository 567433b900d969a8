"""One run at a time per output or checkpoint directory.

`dir_lock(path, flag)` takes an exclusive flock on `.<name>.lock` beside the directory (its
resolved path: links followed, so a symlink to a locked directory is the same lock) and
holds it until the `with` block ends. The lock file is a sibling, not inside the directory,
because --out is swapped in whole at the end of a run (threefold/outdir.py): a lock inside it
would be renamed away with the old contents. The kernel drops a flock when its process dies,
so a killed run never blocks the next one; the file (holding the holder's pid, for the
message) is removed when the lock is given back, and a run that locked a file just removed
tries again on the new one. A second run while the first holds the lock is a one-line
PlanError naming the holder's pid. Re-entrant within a process: a command that holds --out
for the whole run also passes through write_out_dir, which takes the same lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import os

from threefold.errors import PlanError

_held: dict[str, int] = {}     # lock path -> depth, this process's locks (re-entrancy)


def lock_path(path: str) -> str:
    """The lock of the directory `path` resolves to: two runs reaching one directory through
    a symlink (or `..`) take the same lock."""
    full = os.path.realpath(os.path.abspath(path)).rstrip(os.sep) or os.sep
    parent, base = os.path.split(full)
    return os.path.join(parent, f".{base}.lock")


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "another process"


@contextlib.contextmanager
def dir_lock(path: str, flag: str = "--out"):
    """Hold `path` for this process (created parents included); PlanError if another run does."""
    lock = lock_path(path)
    if lock in _held:
        _held[lock] += 1
        try:
            yield
        finally:
            _held[lock] -= 1
        return
    try:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
    except OSError as exc:
        raise PlanError(f"{flag} {path!r} cannot be created ({exc.strerror or exc})") from None
    fd = _acquire(lock, path, flag)
    _held[lock] = 1
    try:
        yield
    finally:
        del _held[lock]
        with contextlib.suppress(OSError):
            os.unlink(lock)          # still ours (we hold it): nobody else can be using this file
        os.close(fd)


def _acquire(lock: str, path: str, flag: str) -> int:
    for _ in range(20):     # retry only when the file we locked was removed under us
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise PlanError(f"{flag} {path!r} cannot be locked: {lock} cannot be written "
                            f"({exc.strerror or exc}); check the directory's permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise PlanError(f"{flag} {path!r} is in use by another threefold run ({who}): wait for it to "
                            "finish, or give another directory") from None
        except OSError as exc:     # a filesystem without flock (some network mounts)
            os.close(fd)
            raise PlanError(f"{flag} {path!r} cannot be locked ({exc.strerror or exc}): give a directory "
                            "on a local filesystem") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if not same:                 # the previous holder removed it as we opened it
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd
    raise PlanError(f"{flag} {path!r} cannot be locked: {lock} keeps changing; is another run starting?")
