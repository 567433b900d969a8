"""Permissions of what threefold creates: what a plain open()/mkdir would give, 0666 or
0777 less the user's umask. tempfile.mkstemp and mkdtemp make 0600 / 0700 whatever the
umask is (right for secrets, wrong for outputs a user shares: exports, SVGs, artifacts,
checkpoints), so every such file or directory that becomes an output goes through here."""
from __future__ import annotations

import os


def current_umask() -> int:
    mask = os.umask(0)     # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


def as_if_created_plainly(path_or_fd, directory: bool = False) -> None:
    """chmod a file (path or open descriptor) to 0666 & ~umask, a directory to 0777 & ~umask."""
    mode = (0o777 if directory else 0o666) & ~current_umask()
    if isinstance(path_or_fd, int):
        os.fchmod(path_or_fd, mode)
    else:
        os.chmod(path_or_fd, mode)
