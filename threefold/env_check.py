"""Every THREEFOLD_* environment variable, checked by the CLI before any rank starts.

Each variable is read where it is used (the runtime reads its own); this checks them all
once, up front, so a bad value is one line (exit 2) in the parent instead of an error on
every rank after start-up, or a traceback. A name close to a known one (a typo) is refused
with a suggestion; other THREEFOLD_* names are left alone (tools of the user's may use them).
"""
from __future__ import annotations

import math
import os

from threefold.errors import PlanError

MIN_TIMEOUT_S = 1.0     # below this the rendezvous itself cannot finish: every rank fails at once


def _seconds(name: str, text: str, lo: float, hi: float, example: str) -> None:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not lo <= value <= hi:          # nan and inf too
        raise PlanError(f"{name}={text!r} is invalid: give seconds from {lo:g} to {hi:.0f}, e.g. {example}")


def _choice(name: str, text: str, choices: tuple[str, ...]) -> None:
    if text.strip().lower() not in choices:
        raise PlanError(f"{name}={text!r} is invalid: use one of {', '.join(repr(c) for c in choices)}")


def _no_file_above(name: str, path: str, what: str) -> None:
    """`path` can be a directory (what=dir) or a file (what=file) to write: no existing
    ancestor (or, for a directory, the path itself) is a file."""
    full = os.path.abspath(path)
    if what == "dir" and os.path.exists(full) and not os.path.isdir(full):
        raise PlanError(f"{name}={path!r} is a file, not a directory: give a directory to write into")
    if what == "file" and os.path.isdir(full):
        raise PlanError(f"{name}={path!r} is a directory: give a file path to write (e.g. trace.json)")
    parent = os.path.dirname(full)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise PlanError(f"{name}={path!r} is under {parent}, which is a file: give a path in a directory")


def _int(name: str, text: str, lo: int, hi: int) -> None:
    if not (text.strip().isascii() and text.strip().isdigit() and lo <= int(text) <= hi):
        raise PlanError(f"{name}={text!r} is invalid: give a whole number from {lo} to {hi}")


def _check_timeout(name, text):
    from threefold.runtime.comm import MAX_TIMEOUT_S
    _seconds(name, text, MIN_TIMEOUT_S, MAX_TIMEOUT_S, "60")


def _check_compile_timeout(name, text):
    from threefold.runtime.comm import MAX_TIMEOUT_S
    _seconds(name, text, MIN_TIMEOUT_S, MAX_TIMEOUT_S, "1800")


def _check_ring(name, text):
    try:
        mb = float(text)
    except ValueError:
        mb = math.nan
    if not 0 < mb <= 2**20:
        raise PlanError(f"{name}={text!r} is invalid: give the MiB a pipeline channel's ring may hold, above 0 "
                        "and at most 1048576, e.g. 256")


def _check_trace_steps(name, text):
    from threefold.runtime.trace import parse_steps
    parse_steps(text, name)


def _check_secret(name, text):
    if not text.strip():
        raise PlanError(f"{name} is empty: give a secret shared by the job's processes, or unset it")


CHECKS = {
    "THREEFOLD_TIMEOUT": _check_timeout,
    "THREEFOLD_COMPILE_TIMEOUT": _check_compile_timeout,
    "THREEFOLD_LOCAL_P2P_MB": _check_ring,
    "THREEFOLD_LOCAL_P2P": lambda n, t: _choice(n, t, ("0", "1")),
    "THREEFOLD_LOCAL_REDUCE": lambda n, t: _choice(n, t, ("0", "1")),
    "THREEFOLD_SDPA_REWRITE": lambda n, t: _choice(n, t, ("0", "1")),
    "THREEFOLD_KERNELS": lambda n, t: _choice(n, t or "auto", ("auto", "triton", "eager")),
    "THREEFOLD_BACKEND": lambda n, t: _choice(n, t, ("gloo", "nccl")),
    "THREEFOLD_MALLOC": lambda n, t: _choice(n, t or "tuned", ("default", "tuned")),
    "THREEFOLD_PIN": lambda n, t: _choice(n, t or "none", ("none", "cores")),
    "THREEFOLD_MAX_LOCAL_RANKS": lambda n, t: _int(n, t, 1, 4096),
    "THREEFOLD_TRACE": lambda n, t: _no_file_above(n, t, "file") if t else None,
    "THREEFOLD_TRACE_STEPS": _check_trace_steps,
    "THREEFOLD_DEBUG_DIR": lambda n, t: _no_file_above(n, t, "dir") if t else None,
    "THREEFOLD_CACHE_DIR": lambda n, t: _no_file_above(n, t, "dir") if t else None,
    "THREEFOLD_JOB_SECRET": _check_secret,
}


def check_env(environ=None) -> None:
    """PlanError (one line) for the first THREEFOLD_* variable whose value is invalid."""
    import difflib
    environ = os.environ if environ is None else environ
    for name in sorted(k for k in environ if k.startswith("THREEFOLD_")):
        check = CHECKS.get(name)
        if check is not None:
            check(name, environ[name])
            continue
        close = difflib.get_close_matches(name, CHECKS, n=1, cutoff=0.85)
        if close:
            raise PlanError(f"{name} is not a threefold setting: did you mean {close[0]}? (unset it, or rename it)")
