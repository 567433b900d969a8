"""Run one function in a short-lived forked child and bring its result back.

Why: compiling imports torch.export and everything it pulls in (torch._dynamo, Triton,
sympy, networkx: about 190 MB of code that stays loaded for the life of a process). On the
rank that compiles for a model read from safetensors, that is more than the rank's shard of
a 2 GB model's remainder budget. In a forked child the compile costs the rank nothing
once the child exits; the child inherits the model (no pickling of user code), and only
the result (generated sources, manifest, program) comes back, pickled through a pipe.

The child runs one thread (torch.set_num_threads(1), as DataLoader workers do after a
fork), dies with its parent (PR_SET_PDEATHSIG), and is bounded by `timeout`; a child that
dies or hangs is an error naming what it was doing, never a hang.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import sys
import time
import traceback

import torch


class ChildFailed(RuntimeError):
    pass


def fork_available() -> bool:
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def run_in_child(fn, *args, what: str = "work", timeout: float = 3600.0):
    """fn(*args) in a forked child; its return value, or the exception it raised (re-raised
    here with its type when it pickles, else as ChildFailed)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        os.close(read_fd)
        status = 0
        try:
            _child_setup()
            try:
                data = pickle.dumps(("ok", fn(*args)))
            except BaseException as exc:           # noqa: BLE001 (sent back, raised there)
                status = 1
                try:
                    data = pickle.dumps(("raised", exc))
                except Exception:
                    data = pickle.dumps(("failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            with os.fdopen(write_fd, "wb") as f:
                f.write(data)
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        data = _read_all(read_fd, pid, timeout, what)
    finally:
        os.close(read_fd)
        _reap(pid)
    if not data:
        raise ChildFailed(f"the child process doing {what} died before it answered")
    kind, value = pickle.loads(data)
    if kind == "ok":
        return value
    if kind == "raised":
        raise value
    raise ChildFailed(f"{what} failed in its child process: {value}")


def _child_setup() -> None:
    torch.set_num_threads(1)                       # the parent's thread pool did not survive the fork
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG: die with the parent
    except Exception:
        pass


def _read_all(fd: int, pid: int, timeout: float, what: str) -> bytes:
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            raise ChildFailed(f"{what} did not finish within {timeout:.0f} s in its child process; it was killed")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:                              # EOF: the child wrote everything (or died)
            return b"".join(chunks)
        chunks.append(chunk)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
