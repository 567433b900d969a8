"""Every THREEFOLD_* environment variable, checked by the CLI before any rank starts.

Each variable is read where it is used (the runtime reads its own); this checks them all
once, up front, so a bad value is one line (exit 2) in the parent instead of an error on
every rank after start-up, or a traceback. A name close to a known one (a typo) is refused
with a suggestion; other THREEFOLD_* names are left alone (tools of the user's may use them).
"""
from __future__ import annotations

import difflib
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
    from threefold.runtime.comm import MAX_TIMEOUT_S   # lazy: start-up: runtime.comm loads only on this path
    _seconds(name, text, MIN_TIMEOUT_S, MAX_TIMEOUT_S, "60")


def _check_compile_timeout(name, text):
    from threefold.runtime.comm import MAX_TIMEOUT_S   # lazy: start-up: runtime.comm loads only on this path
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
    from threefold.runtime.trace import parse_steps   # lazy: start-up: runtime.trace loads only on this path
    parse_steps(text, name)


def _check_secret(name, text):
    if not text.strip():
        raise PlanError(f"{name} is empty: give a secret shared by the job's processes, or unset it")


_BOOL = lambda n, t: _choice(n, t, ("0", "1"))  # noqa: E731


# Every THREEFOLD_* variable the package reads: its check (None: any value) and what it does.
# One table: the CLI's up-front check and the docs' reference page (tools/docs_reference.py)
# both read it, and the docs build fails on a variable read in the code but missing here.
VARIABLES: dict[str, tuple] = {
    "THREEFOLD_TIMEOUT": (_check_timeout, "seconds every distributed wait may take (default 60); a dead or "
                          "hung rank ends the job within it + 10 s, naming the rank"),
    "THREEFOLD_COMPILE_TIMEOUT": (_check_compile_timeout, "seconds peers wait while rank 0 compiles, and during "
                                  "the first steps under `compile=inductor` (default ten times THREEFOLD_TIMEOUT, "
                                  "at least 600)"),
    "THREEFOLD_DEBUG_DIR": (lambda n, t: _no_file_above(n, t, "dir") if t else None,
                            "a directory: dump the program after every compiler pass"),
    "THREEFOLD_TRACE": (lambda n, t: _no_file_above(n, t, "file") if t else None,
                        "a directory: `parallelize` traces the steps THREEFOLD_TRACE_STEPS names into "
                        "DIR/trace.json and DIR/trace.html"),
    "THREEFOLD_TRACE_STEPS": (_check_trace_steps, "which `pm.step` calls THREEFOLD_TRACE records (default 3)"),
    "THREEFOLD_CACHE_DIR": (lambda n, t: _no_file_above(n, t, "dir") if t else None,
                            "where tokenised text is cached (default ~/.cache/threefold/tokens)"),
    "THREEFOLD_JOB_SECRET": (_check_secret, "under torchrun: the same random value on every node authenticates "
                             "the store's keys (the local launcher makes its own)"),
    "THREEFOLD_BACKEND": (lambda n, t: _choice(n, t, ("gloo", "nccl")),
                          "gloo: use gloo even where CUDA is available (default: nccl on CUDA, else gloo)"),
    "THREEFOLD_KERNELS": (lambda n, t: _choice(n, t or "auto", ("auto", "triton", "eager")),
                          "fused kernels: auto (default: Triton on a GPU), triton (also under "
                          "TRITON_INTERPRET=1) or eager (never)"),
    "THREEFOLD_LOCAL_P2P": (_BOOL, "0: pipeline messages between ranks on one host go through gloo, not "
                            "shared memory"),
    "THREEFOLD_LOCAL_P2P_MB": (_check_ring, "MiB per direction of the shared-memory message ring (default 256)"),
    "THREEFOLD_LOCAL_REDUCE": (_BOOL, "0: data-parallel CPU ranks on one host all-reduce with gloo, not "
                               "shared memory"),
    "THREEFOLD_MALLOC": (lambda n, t: _choice(n, t or "tuned", ("default", "tuned")),
                         "default: keep glibc malloc's defaults (threefold otherwise keeps freed memory for reuse)"),
    "THREEFOLD_MAX_LOCAL_RANKS": (lambda n, t: _int(n, t, 1, 4096),
                                  "the most ranks a local (non-torchrun) run starts (default 4 per core)"),
    "THREEFOLD_PIN": (lambda n, t: _choice(n, t or "none", ("none", "cores")),
                      "cores: pin each local rank and its threads to cores of its own (default none)"),
    "THREEFOLD_SDPA_REWRITE": (_BOOL, "0: under compile=inductor on the CPU, keep hand-written attention as "
                               "written instead of one scaled_dot_product_attention call"),
    "THREEFOLD_PROGRESS": (_BOOL, "1: print one plain line per compile phase even off a terminal (on a "
                           "terminal a status line shows them; `--json` is always quiet)"),
    "THREEFOLD_ELASTIC_DROP_DEAD": (_BOOL, "1: under `train --max-restarts`, ranks that died or stopped are "
                                    "gone for good (the job restarts on fewer ranks, as after a lost node)"),
    "THREEFOLD_COMPILED": (None, "internal: set by `train`/`check` for their ranks (the parent's compile, in a "
                           "private temporary file); not for users"),
    "THREEFOLD_FALLBACKS_SHOWN": (None, "internal: set by a command that printed the fallback summary, so "
                                  "its ranks do not repeat it"),
}
CHECKS = {name: check for name, (check, _) in VARIABLES.items() if check is not None}


def check_env(environ=None) -> None:
    """PlanError (one line) for the first THREEFOLD_* variable whose value is invalid."""
    environ = os.environ if environ is None else environ
    for name in sorted(k for k in environ if k.startswith("THREEFOLD_")):
        if name in VARIABLES:
            if name in CHECKS:
                CHECKS[name](name, environ[name])
            continue
        close = difflib.get_close_matches(name, VARIABLES, n=1, cutoff=0.85)
        if close:
            raise PlanError(f"{name} is not a threefold setting: did you mean {close[0]}? (unset it, or rename it)")
