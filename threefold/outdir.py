"""Output directories that never lose a user's data.

Every directory threefold writes (`compile --out`, `train --out`) is built in a fresh
temporary sibling and renamed into place, with a marker file listing what we wrote. An
existing directory is replaced only when it is empty or one of ours: the marker is there and
lists every file in it. Nothing else counts as ours (files that merely look like a run or an
artifact may be the user's); anything else is refused with a PlanError unless `force`, and
even then it is moved aside, never deleted.
`check_out_dir` runs the same checks up front, so a bad path fails before any work starts.
One run at a time owns a directory: `dir_lock` (threefold/dir_lock.py) is held while a run
writes it, and a second run on the same directory is refused, naming the holder's pid.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from typing import Callable

from threefold.errors import PlanError, Terminated
from threefold.file_modes import as_if_created_plainly

MARKER = ".threefold-out.json"          # {"kind": ..., "files": [relative paths we wrote]}


def _listing(path: str) -> set[str]:
    """Every entry under path (files, links, empty dirs), relative, without following links."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        rel = os.path.relpath(dirpath, path)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(os.path.normpath(os.path.join(rel, name)))
    return out


def _ours(path: str) -> bool:
    """True when the directory holds our marker and every file in it is one the marker lists.
    Without the marker nothing is ours, however much it looks like a run (the issue-26 rule:
    a user's losses.json and loss.png are the user's)."""
    files = _listing(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker) or os.path.islink(marker) or os.path.getsize(marker) > 16 << 20:
        return False
    try:
        with open(marker) as f:
            record = json.load(f)
        listed = {os.path.normpath(p) for p in record["files"]}
        stamps = record.get("stamps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return False
    if not files <= listed | {MARKER}:
        return False
    return _unchanged(path, stamps)


def _stamps(path: str) -> dict[str, list[int]]:
    """[size, mtime_ns] of every regular file under path: what a later run compares to see
    whether the user changed a file threefold wrote."""
    out = {}
    for rel in _listing(path):
        st = os.lstat(os.path.join(path, rel))
        if stat.S_ISREG(st.st_mode):
            out[rel] = [st.st_size, st.st_mtime_ns]
    return out


def _unchanged(path: str, stamps) -> bool:
    """Every file the marker stamped is as threefold wrote it (a marker without stamps, from an
    older threefold, is trusted by its listing alone)."""
    if stamps is None:
        return True
    if not isinstance(stamps, dict):
        return False
    for rel, stamp in stamps.items():
        full = os.path.join(path, os.path.normpath(str(rel)))
        try:
            st = os.lstat(full)
        except OSError:
            continue            # removed since: nothing of the user's to lose
        if not stat.S_ISREG(st.st_mode) or [st.st_size, st.st_mtime_ns] != stamp:
            return False
    return True


def check_out_dir(path: str, force: bool = False, flag: str = "--out") -> None:
    """Raise PlanError if writing the directory `path` could harm what is there."""
    if not path or not str(path).strip():
        raise PlanError(f"{flag} is empty: give a directory to write")
    full = os.path.abspath(path)
    cwd = os.path.abspath(os.getcwd())
    if full == os.path.dirname(full):
        raise PlanError(f"{flag} {path!r} is the filesystem root: give a new or threefold-made directory")
    if cwd == full or cwd.startswith(full.rstrip(os.sep) + os.sep):
        raise PlanError(f"{flag} {path!r} is the current directory or holds it: give a new directory "
                        "such as ./out")
    if os.path.islink(full):
        if not force:
            raise PlanError(f"{flag} {path!r} is a symbolic link: give a plain directory, or --force to move "
                            "the link aside")
    elif os.path.exists(full) and not os.path.isdir(full):
        raise PlanError(f"{flag} {path!r} is an existing file, not a directory: give a directory path")
    elif os.path.isdir(full) and os.listdir(full) and not force and not _ours(full):
        raise PlanError(f"{flag} {path!r} is a non-empty directory threefold did not write: give a new "
                        "directory, or --force to move it aside (nothing is deleted)")
    parent = os.path.dirname(full)
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise PlanError(f"{flag} {path!r} cannot be created: {existing!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PlanError(f"{flag} {path!r} cannot be written: no write permission in {existing!r}")


def write_out_dir(path: str, fill: Callable[[str], None], kind: str, force: bool = False,
                  flag: str = "--out") -> str | None:
    """Build the directory with fill(tmp) in a temporary sibling, then rename it to `path`.

    Returns where a directory that was not ours went (with `force`), else None. Holds the
    directory's lock (threefold/dir_lock.py) while it checks and swaps; a full disk is a
    one-line PlanError, the old directory left as it was."""
    from threefold.dir_lock import dir_lock   # lazy: start-up: dir_lock loads only on this path
    with dir_lock(path, flag):
        try:
            return _write_out_dir(path, fill, kind, force, flag)
        except OSError as exc:
            if is_disk_full(exc):
                raise PlanError(f"{flag} {path!r} could not be written: {disk_full(exc)}") from None
            raise


def is_disk_full(exc: BaseException) -> bool:
    """An OSError (or one wrapped by torch's checkpoint writer) for a full disk or quota."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def disk_full(exc: BaseException | None = None) -> str:
    return "the disk is full (no space left on device); free some space or write to another disk"


def _write_out_dir(path: str, fill: Callable[[str], None], kind: str, force: bool, flag: str) -> str | None:
    check_out_dir(path, force, flag)
    full = os.path.abspath(path)
    parent, base = os.path.split(full)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise PlanError(f"{flag} {path!r} cannot be created ({exc.strerror})") from None
    with sigterm_raises():     # SIGTERM while writing: the temporary directory is removed, not left
        return _fill_and_swap(full, parent, base, fill, kind)


@contextlib.contextmanager
def sigterm_raises(what: str = "writing the output directory"):
    """SIGTERM raises Terminated (so `except BaseException` cleans up) instead of ending the
    process where it stands; only in the main thread, where signal handlers run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated(f"terminated by SIGTERM while {what} (nothing half-written was left)")
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _fill_and_swap(full: str, parent: str, base: str, fill, kind: str) -> str | None:
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        as_if_created_plainly(tmp, directory=True)   # mkdtemp makes 0700; a plain mkdir would not
        fill(tmp)
        record = {"kind": kind, "files": sorted(_listing(tmp) - {MARKER}), "stamps": _stamps(tmp)}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(record, f, indent=1)
        moved_aside = None
        if os.path.lexists(full):
            if not os.path.islink(full) and os.path.isdir(full) and not os.listdir(full):
                os.rmdir(full)                      # empty: nothing to lose
            elif not os.path.islink(full) and _ours(full):
                old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
                os.replace(full, os.path.join(old, base))
                os.replace(tmp, full)
                shutil.rmtree(old)                  # only files we wrote (checked by _ours)
                return None
            else:                                   # --force: move the user's directory aside
                moved_aside = f"{full}.moved-{time.strftime('%Y%m%d-%H%M%S')}"
                n = 1
                while os.path.lexists(moved_aside):
                    moved_aside = f"{full}.moved-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
                    n += 1
                os.replace(full, moved_aside)
        os.replace(tmp, full)
        return moved_aside
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)   # our own temporary directory
        raise


def check_out_file(path: str, flag: str) -> None:
    """A file output (--svg FILE): not a directory, in a directory that exists and is writable."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise PlanError(f"{flag} {path!r} is a directory: give a file name")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise PlanError(f"{flag} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlanError(f"{flag} {path!r} cannot be written: no write permission in {parent!r}")


def write_file_atomically(path: str, text: str) -> None:
    """Write a text file through a temporary sibling, so a failure leaves the old file."""
    full = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(full)}.tmp-", dir=os.path.dirname(full))
    try:
        as_if_created_plainly(fd)               # mkstemp makes 0600; open(path, "w") would not
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, full)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
