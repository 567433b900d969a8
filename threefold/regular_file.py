"""Refuse files that are not files: a FIFO blocks the reader forever (opening it blocks too),
a character device such as /dev/zero never ends. Checked by what the path is, before it is
opened, wherever a user's path is read whole (--data, --config, artifact files)."""
from __future__ import annotations

import os
import stat

from threefold.errors import PlanError


def kind_of(mode: int) -> str | None:
    """None for a regular file, else what it is in words."""
    if stat.S_ISREG(mode):
        return None
    return ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a directory" if stat.S_ISDIR(mode) else "not a regular file")


def require_regular_file(path: str, what: str) -> None:
    """PlanError "<what> is a named pipe (FIFO): give a regular file" unless `path` (links
    followed) is a regular file; `what` names it as the user gave it, e.g. "--data 'x'"."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise PlanError(f"{what} cannot be read: {exc.strerror or exc}") from None
    kind = kind_of(mode)
    if kind is not None:
        raise PlanError(f"{what} is {kind}: give a regular file")
