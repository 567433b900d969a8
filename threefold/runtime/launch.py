"""Local multi-process launcher (gloo on CPU) and torchrun environment support.

`launch(fn, nprocs, *args)` starts nprocs processes, each with the default process group
initialised (gloo, bounded by THREEFOLD_TIMEOUT), runs fn(*args) in each and returns their
results in rank order. Faults are bounded:

- The rendezvous store lives in this (parent) process, bound to 127.0.0.1, so a rank that
  dies or hangs (rank 0 included) never takes the store with it: the others can still
  read who failed, and the parent posts what it sees (a rank that died or is stopped).
- The store is the job's own: a per-job secret, handed to the ranks with their arguments,
  namespaces its keys and authenticates its values (runtime/job_store.py), so another
  local process that writes rendezvous keys is ignored (or named), not obeyed.
- Ranks are spawned, or, after prestart() (the CLI's `train`, Linux), forked from a
  forkserver that imported torch once for all of them; either way with the launcher's
  environment of the moment. Every rank asks the kernel to kill it when its parent (the
  launcher or its forkserver, which ends with the launcher) dies (PR_SET_PDEATHSIG) and also
  polls both, so a killed launcher leaves no orphans.
- When a rank fails or dies, the others get a short grace to fail on their own (they name
  the rank they lost; none for bad input, whose cause is already known), then every rank
  left is sent SIGTERM and, after a second, SIGKILL (which also ends stopped ranks).
- SIGTERM to the launcher stops every rank the same way and raises `Terminated`.

A `LaunchError` says which rank failed first, with its traceback, and every other rank in
one line (runtime/failure_report.py); its `errors` keep every rank's full report. Under torchrun, `init_from_env()` joins the existing job.
"""
from __future__ import annotations

import atexit
import ctypes
from multiprocessing import forkserver
import multiprocessing as mp
from multiprocessing.connection import wait
import os
import pickle
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from threefold.errors import Terminated
from threefold.runtime import affinity
from threefold.runtime.allocator import tune_malloc
from threefold.runtime.comm import FAILURE_KEY, default_timeout, post_failure, use_failure_store
from threefold.runtime.failure_report import failure_report, rank_traceback
from threefold.runtime.job_store import SECRET_ENV, JobStore, new_secret

GRACE_S = 5.0          # after the first failure, how long the other ranks get to report
KNOWN_CAUSE_GRACE_S = 2.0   # ... when the launcher itself saw the cause (a rank died or stopped)
KILL_AFTER_S = 1.0     # SIGTERM, then SIGKILL this much later


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None) -> None:
    """Join the job described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun's env).
    With THREEFOLD_JOB_SECRET set (the same value on every node), the job's keys in
    torchrun's store are namespaced and authenticated by it (runtime/job_store.py)."""
    if dist.is_initialized():
        return
    tune_malloc()   # freed memory stays for the next microbatch (runtime/allocator.py)
    affinity.pin_rank(int(os.environ.get("LOCAL_RANK", "0")), torch.get_num_threads())  # THREEFOLD_PIN
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("THREEFOLD_BACKEND") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    secret = os.environ.get(SECRET_ENV)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not secret and attempt == "0":
        dist.init_process_group(backend, timeout=default_timeout())
        return
    store, rank, world = next(dist.rendezvous("env://", timeout=default_timeout()))
    if attempt != "0":
        # restarted by torchrun's agent on the same store: the failed attempt's keys (the
        # ranks' addresses of every process group, its posted failure) must not be read
        # as this attempt's
        store = dist.PrefixStore(f"threefold/attempt{attempt}/", store)
    if not secret:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=default_timeout())
        return
    store = JobStore(store, secret)
    use_failure_store(store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=default_timeout())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _die_with_parent(launcher_pid: int) -> None:
    """End this rank when the launcher ends, however it ends (no orphans). The rank's parent
    is the launcher (spawn) or the launcher's forkserver, which exits when the launcher does:
    the kernel's parent-death signal covers both, and the watch also polls the launcher."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)          # PR_SET_PDEATHSIG = 1
        except Exception:
            pass
    parent = os.getppid()
    if parent == 1 or not _alive(launcher_pid):             # launcher (or forkserver) already gone
        os._exit(1)

    def watch():                                            # portable fallback
        while True:
            time.sleep(1.0)
            if os.getppid() != parent or not _alive(launcher_pid):
                os._exit(1)
    threading.Thread(target=watch, name="threefold-parent-watch", daemon=True).start()


# What a forkserver imports once for every rank it starts: torch, and torch._dynamo, which
# every torch.optim optimizer imports when it is built (about a second each per process).
PRELOAD = ["torch", "torch._dynamo", "threefold.runtime.launch"]
_forkserver_owned = False       # prestart() ran: this process's launches start ranks from it


def start_context():
    """How ranks start: spawned, or, once prestart() has run (the CLI's `train`), forked
    from a forkserver with PRELOAD imported (Linux). Either way a rank is a fresh process
    image that never shares the launcher's threads or state: the forkserver is a clean
    interpreter of its own."""
    if _forkserver_owned:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


def prestart() -> None:
    """Start the ranks' forkserver now, so that its imports overlap the caller's own work
    (the parent's compile in `threefold train`) instead of delaying every rank. It is killed
    and reaped when this process exits (bad input found by that work included): nothing
    outlives the command, and the ranks' CPU time is accounted to it as a spawned rank's is."""
    global _forkserver_owned
    if _forkserver_owned or not sys.platform.startswith("linux") or \
            "forkserver" not in mp.get_all_start_methods():
        return
    _forkserver_owned = True
    start_context()             # its preload list, before it starts
    forkserver.ensure_running()
    atexit.register(_kill_forkserver)


def _kill_forkserver() -> None:
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


class _Reports:
    """What the ranks report to the launcher: one pipe per rank, no semaphores.

    A multiprocessing.Queue makes three named POSIX semaphores (/dev/shm/sem.mp-*) that only
    the resource tracker removes; a process group killed with SIGKILL takes the tracker with
    it and leaves them behind. A pipe is two file descriptors the kernel closes whatever
    happens."""

    def __init__(self, ctx, n: int):
        pairs = [ctx.Pipe(duplex=False) for _ in range(n)]
        self.readers = [r for r, _ in pairs]
        self.writers = [w for _, w in pairs]
        self.open = set(range(n))

    def get(self, timeout: float):
        """(rank, status, value) of one report, or None when none came within timeout."""
        if not self.open:
            return None         # every rank's pipe is at its end: nothing can come
        ready = wait([self.readers[r] for r in self.open], timeout)
        for conn in ready:
            r = self.readers.index(conn)
            try:
                return pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self.open.discard(r)    # the rank exited without (more to) report
                conn.close()
        return None

    def close(self) -> None:
        for c in self.readers + self.writers:
            try:
                c.close()
            except OSError:
                pass


def _report(conn, item) -> None:
    conn.send_bytes(pickle.dumps(item))


def _set_environ(environ: dict) -> dict:
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    return environ


class _Environ:
    """The launcher's environment, put in place in the rank as it is unpickled. It is the
    worker's first argument, so it is in place before the function and its arguments are
    unpickled (which may import modules that read it): a forkserver's own environment is
    the one it started with, the rank gets the launcher's of the moment, as if spawned."""

    def __init__(self):
        self.environ = dict(os.environ)

    def __reduce__(self):
        return _set_environ, (self.environ,)


def _worker(environ: dict, rank: int, world: int, port: int, secret: str, fn, args, queue, threads: int,
            parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # local job: gloo on loopback too
    torch.set_num_threads(threads)
    tune_malloc()   # freed memory stays for the next microbatch (runtime/allocator.py)
    try:
        affinity.pin_rank(rank, threads)   # THREEFOLD_PIN=cores (runtime/affinity.py)
        timeout = default_timeout()
        store = JobStore(dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout), secret)
        use_failure_store(store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        _report(queue, (rank, "up", None))      # joined the job: the start-up watchdog lets go
        # Plain pickle copies tensors into the bytes; the queue's own pickler would share
        # their storage, which vanishes when this process exits.
        result = pickle.dumps(fn(*args))
        _report(queue, (rank, "ok", result))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        msg = f"{type(exc).__name__}: {exc}"
        try:
            _report(queue, (rank, "error", msg + "\n" + rank_traceback(exc)))
        except Exception:
            pass
        post_failure(f"rank {rank}: {msg.splitlines()[0][:300]}")
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _store_server(world: int):
    """The rendezvous store, hosted here and listening on loopback only."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, world))
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world, True, timeout=default_timeout(),
                          wait_for_workers=False, master_listen_fd=sock.detach())  # the store owns it now
    return store, port


def _stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP / SIGTSTP); Linux /proc only."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def start_limit() -> float:
    """How long a rank may take from its start to joining the job (imports, unpickling its
    arguments, which imports a SPEC's module, and the rendezvous): the rendezvous's own
    bound plus time for imports on a loaded host. A rank past it is blocked (a FIFO opened
    at import, a hung import) and the job is stopped instead of waiting forever."""
    return default_timeout().total_seconds() + START_IMPORT_S


START_IMPORT_S = 240.0


def launch(fn, nprocs: int, *args, threads: int = 1, timeout: float | None = None,
           grace: float | None = None, start_timeout: float | None = None) -> list:
    """Run fn(*args) on nprocs local gloo ranks; results in rank order. Every rank must
    join the job within `start_timeout` seconds (default start_limit())."""
    if nprocs == 1 and dist.is_initialized():
        return [fn(*args)]
    # lazy: start-up: runtime.capacity loads only on this path
    from threefold.runtime.capacity import check_local_capacity
    check_local_capacity(nprocs)   # the CLI's guard: 16 ranks on 2 cores is refused, not thrashed
    affinity.mode()     # a bad THREEFOLD_PIN is a PlanError here, before any rank starts
    ctx = start_context()
    queue = _Reports(ctx, nprocs)
    secret = new_secret()                   # the job's own store (runtime/job_store.py)
    server, port = _store_server(nprocs)
    store = JobStore(server, secret)
    procs = [ctx.Process(target=_worker, args=(_Environ(), r, nprocs, port, secret, fn, args, queue.writers[r],
                                               threads, os.getpid()),
                         daemon=True) for r in range(nprocs)]
    results: dict[int, tuple[str, object]] = {}
    causes: dict[int, str] = {}             # what the parent saw: a rank died or stopped
    stopped_since: dict[int, float] = {}
    limit = default_timeout().total_seconds()
    first_failure: float | None = None
    deadline = time.monotonic() + timeout if timeout else None
    up: set[int] = set()                    # ranks that joined the job
    start_s = start_limit() if start_timeout is None else start_timeout
    start_by = time.monotonic() + start_s

    def post(message: str) -> None:
        try:
            store.set(FAILURE_KEY, message)
        except Exception:
            pass

    def on_term(signum, frame):
        raise Terminated("terminated by SIGTERM: every rank was stopped")
    in_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, on_term) if in_main else None
    try:
        for p, w in zip(procs, queue.writers):
            p.start()
            w.close()          # the rank holds its end now: EOF on ours means it is gone
        last_scan = 0.0
        while len(results) < nprocs:
            _drain(queue, results, up=up)
            now = time.monotonic()
            if now > start_by and len(up) < nprocs:    # the start-up watchdog
                for r in range(nprocs):
                    if r not in up and r not in results:
                        causes[r] = (f"rank {r} did not join the job within {start_s:.0f} s "
                                     "of starting (blocked before its process group: a hung import, or a FIFO "
                                     "opened at start-up) and was stopped")
                        results[r] = ("error", causes[r])
                        post(causes[r])
                start_by = float("inf")
            for r, p in enumerate(procs):
                if r not in results and not p.is_alive():
                    _drain(queue, results, wait=5.0 if p.exitcode == 0 else 0.5, up=up)
                    if r not in results:
                        causes[r] = f"rank {r} died ({_death(p.exitcode)})"
                        results[r] = ("error", causes[r])
                        post(causes[r])
            if now - last_scan > 0.5:     # stopped ranks cannot report: look for them
                last_scan = now
                for r, p in enumerate(procs):
                    if r in results or not _stopped(p.pid):
                        stopped_since.pop(r, None)
                        continue
                    since = stopped_since.setdefault(r, now)
                    if now - since > 1.0 and r not in causes:
                        causes[r] = f"rank {r} is stopped (SIGSTOP or a debugger)"
                        post(causes[r])
                    if now - since > limit:   # nobody waits forever on it; its peers fail at once
                        results[r] = ("error", f"rank {r} was stopped for over {limit:.0f} s and was killed")
                        p.kill()
            failed = [s for s, _ in results.values() if s == "error"]
            if first_failure is None and failed:
                first_failure = now
            if first_failure is not None:
                bad_input = any(str(v).startswith("PlanError: ") for s, v in results.values() if s == "error")
                wait = grace if grace is not None else (KNOWN_CAUSE_GRACE_S if causes else GRACE_S)
                if bad_input or now - first_failure > wait:
                    break
            if deadline is not None and now > deadline:
                for r in range(nprocs):
                    results.setdefault(r, ("error", f"rank {r} did not finish within {timeout:.0f} s"))
                break
            time.sleep(0.02)
    finally:
        _stop_all(procs)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        del store, server
        queue.close()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}   # in the order they came
    for r in range(nprocs):
        if r not in results:
            errors[r] = causes.get(r, f"rank {r} was stopped after another rank failed")
    for r, cause in causes.items():
        if r in errors and cause not in str(errors[r]):
            errors[r] = f"{cause}; {errors[r]}"
    if errors:
        # the first failure with its traceback, the others one line each (failure_report.py)
        err = LaunchError(failure_report(errors, causes, nprocs))
        err.errors = errors
        err.causes = causes
        raise err from None
    return [pickle.loads(results[r][1]) for r in range(nprocs)]


def _stop_all(procs) -> None:
    """SIGTERM every live rank, SIGKILL what is left a second later, reap them all."""
    alive = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in alive:
        try:
            p.terminate()
        except Exception:
            pass
    end = time.monotonic() + KILL_AFTER_S
    while time.monotonic() < end and any(p.is_alive() for p in alive):
        time.sleep(0.02)
    for p in alive:
        if p.is_alive():
            try:
                p.kill()          # a stopped process cannot act on SIGTERM; SIGKILL ends it
            except Exception:
                pass
    for p in alive:
        p.join(timeout=5)


def _drain(queue, results, wait: float = 0.0, up: set | None = None) -> None:
    """Collect what the ranks reported. A rank that has exited may still have its result
    in its pipe (large results), so callers can wait a little."""
    while True:
        item = queue.get(timeout=wait)
        if item is None:
            return
        rank, status, value = item
        if status == "up":
            if up is not None:
                up.add(rank)
            continue
        if results.get(rank, ("",))[0] != "error" or status == "error":
            results[rank] = (status, value)
        wait = 0.0
