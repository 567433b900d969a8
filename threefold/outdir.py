"""Output directories that never lose a user's data.

Every directory threefold writes (`compile --out`, `train --out`) is built in a fresh
temporary sibling and renamed into place, with a marker file listing what we wrote. An
existing directory is replaced only when it is empty or one of ours (the marker lists every
file in it, or an older threefold artifact/run whose files we can recognise); anything else
is refused with a PlanError unless `force`, and even then it is moved aside, never deleted.
`check_out_dir` runs the same checks up front, so a bad path fails before any work starts.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Callable

from threefold.errors import PlanError
from threefold.file_modes import as_if_created_plainly

MARKER = ".threefold-out.json"          # {"kind": ..., "files": [relative paths we wrote]}
_LEGACY_RUN_FILES = {"losses.json", "loss.png"}


def _listing(path: str) -> set[str]:
    """Every entry under path (files, links, empty dirs), relative, without following links."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        rel = os.path.relpath(dirpath, path)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(os.path.normpath(os.path.join(rel, name)))
    return out


def _ours(path: str) -> bool:
    """True when every file in the directory is one threefold wrote there."""
    files = _listing(path)
    marker = os.path.join(path, MARKER)
    if os.path.isfile(marker) and not os.path.islink(marker):
        try:
            with open(marker) as f:
                listed = {os.path.normpath(p) for p in json.load(f)["files"]}
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return files <= listed | {MARKER}
    if files and files <= _LEGACY_RUN_FILES:
        return True
    manifest = os.path.join(path, "manifest.json")   # artifacts written before the marker
    if os.path.isfile(manifest) and not os.path.islink(manifest):
        try:
            with open(manifest) as f:
                m = json.load(f)
            listed = set(m["files"]) | {"manifest.json", "batch.safetensors"}
            for c in m.get("chunks", []):
                listed |= set(c.get("weights", {}).values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return "threefold_version" in m and files <= {os.path.normpath(p) for p in listed}
    return False


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

    Returns where a directory that was not ours went (with `force`), else None."""
    check_out_dir(path, force, flag)
    full = os.path.abspath(path)
    parent, base = os.path.split(full)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise PlanError(f"{flag} {path!r} cannot be created ({exc.strerror})") from None
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        as_if_created_plainly(tmp, directory=True)   # mkdtemp makes 0700; a plain mkdir would not
        fill(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"kind": kind, "files": sorted(_listing(tmp) - {MARKER})}, f, indent=1)
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
