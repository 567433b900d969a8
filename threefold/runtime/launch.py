"""Local multi-process launcher (gloo on CPU) and torchrun environment support.

`launch(fn, nprocs, *args)` starts nprocs processes, each with the default process group
initialised (gloo, bounded timeout), runs fn(*args) in each and returns their results in
rank order. If any rank fails or dies, the others are given a short grace period to fail
on their own (they name the rank they lost), then are stopped, and a `LaunchError` lists
what every rank reported. Under torchrun, `init_from_env()` joins the existing job.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback

import torch
import torch.distributed as dist

from threefold.runtime.comm import default_timeout, post_failure


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None) -> None:
    """Join the job described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun's env)."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("THREEFOLD_BACKEND") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=default_timeout())


def _worker(rank: int, world: int, port: int, fn, args, queue, threads: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=default_timeout())
        # Plain pickle copies tensors into the bytes; the queue's own pickler would share
        # their storage, which vanishes when this process exits.
        result = pickle.dumps(fn(*args))
        queue.put((rank, "ok", result))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        msg = f"{type(exc).__name__}: {exc}"
        post_failure(f"rank {rank}: {msg.splitlines()[0][:300]}")
        queue.put((rank, "error", msg + "\n" + traceback.format_exc(limit=6)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch(fn, nprocs: int, *args, threads: int = 1, timeout: float | None = None,
           grace: float = 60.0) -> list:
    """Run fn(*args) on nprocs local gloo ranks; results in rank order."""
    if nprocs == 1 and dist.is_initialized():
        return [fn(*args)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, queue, threads), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    first_failure: float | None = None
    deadline = time.monotonic() + timeout if timeout else None
    try:
        while len(results) < nprocs:
            _drain(queue, results)
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in results and not p.is_alive():
                    _drain(queue, results, wait=5.0 if p.exitcode == 0 else 0.5)
                    if r not in results:
                        results[r] = ("error", f"rank {r} died (exit code {p.exitcode})")
            if first_failure is None and any(s == "error" for s, _ in results.values()):
                first_failure = now
            if first_failure is not None and now - first_failure > grace:
                break
            if deadline is not None and now > deadline:
                for r in range(nprocs):
                    results.setdefault(r, ("error", f"rank {r} did not finish within {timeout:.0f} s"))
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    for r in range(nprocs):
        if r not in results:
            errors[r] = f"rank {r} was stopped after another rank failed"
    if errors:
        lines = [f"  rank {r}: {str(v).splitlines()[0]}" for r, v in sorted(errors.items())]
        err = LaunchError(f"{len(errors)} of {nprocs} ranks failed:\n" + "\n".join(lines))
        err.errors = errors
        raise err from None
    return [pickle.loads(results[r][1]) for r in range(nprocs)]


def _drain(queue, results, wait: float = 0.0) -> None:
    """Collect what the ranks reported. A rank that has exited may still have its result
    in flight through the queue's pipe (large results), so callers can wait a little."""
    while True:
        try:
            rank, status, value = queue.get(timeout=wait) if wait else queue.get_nowait()
        except Exception:
            return
        results[rank] = (status, value)
        wait = 0.0
