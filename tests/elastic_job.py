"""A `threefold train` job run as a subprocess for the elastic tests: its stderr read as it
comes (to act on "restarting from ..."), its ranks found and signalled, and what a finished
job must not leave behind (processes, /dev/shm files) checked."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from tests.parity import ROOT

SMALL = ["--batch", "4", "--seq", "16", "--sample-tokens", "0", "--eval-every", "0", "--json"]


def descendants(pid: int) -> list[int]:
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier]
        out += kids
        frontier = kids
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def ranks_of(pid: int) -> list[int]:
    """The job's rank processes: spawned children running multiprocessing's spawn_main, or
    the children of the job's forkserver (runtime/launch.py: `train` starts ranks from one)."""
    found = []
    for c in descendants(pid):
        cmd = _cmdline(c)
        if b"spawn_main" in cmd or (b"multiprocessing.forkserver" in cmd
                                    and b"multiprocessing.forkserver" in _cmdline(_ppid(c))):
            found.append(c)
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _mapped() -> set[str]:
    """Names under /dev/shm that some live process has mapped."""
    names = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/maps") as f:
                    # a file's name, and the folder under /dev/shm it is in (a staging folder:
                    # checkpoint/staging.py)
                    names.update(n for line in f if "/dev/shm/" in line
                                 for n in (line.split()[-1].rsplit("/", 1)[-1],
                                           line.split()[-1].split("/dev/shm/", 1)[-1].split("/", 1)[0]))
            except OSError:
                pass
    return names


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("threefold-") or n.startswith("sem.mp-")} \
        if os.path.isdir("/dev/shm") else set()


class Job:
    def __init__(self, out, *args, env=None):
        self.out = str(out)
        self.lines: list[str] = []
        self.shm_before = shm_names()
        self.proc = subprocess.Popen([sys.executable, "-m", "threefold", "train", *SMALL, "--out", self.out, *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.stdout = ""
        self.seen: set[int] = set()      # every rank process seen, to check none outlives the job
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def _watch(self):
        while self.proc.poll() is None:
            self.seen.update(ranks_of(self.proc.pid))
            time.sleep(0.3)

    def wait_for(self, what, timeout=300.0):
        """Wait until `what()` is true (a callable) or a stderr line matches (a regex); the match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(what):
                if what():
                    return True
            else:
                for line in list(self.lines):
                    m = re.search(what, line)
                    if m:
                        return m
            assert self.proc.poll() is None, f"the job ended ({self.proc.returncode}):\n{''.join(self.lines)[-3000:]}"
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}:\n{''.join(self.lines)[-3000:]}")

    def signal_rank(self, index: int, sig=signal.SIGKILL) -> float:
        ranks = self.wait_for(lambda: len(ranks_of(self.proc.pid)) > index) and ranks_of(self.proc.pid)
        os.kill(ranks[index], sig)
        return time.time()

    def finish(self, timeout=600.0) -> dict:
        self.stdout, _ = self.proc.communicate(timeout=timeout)
        self._reader.join(timeout=10)
        err = "".join(self.lines)
        assert self.proc.returncode == 0, err[-4000:]
        alive = [p for p in self.seen if _alive(p)]
        assert alive == [], f"rank processes left behind: {alive}"
        # other processes here (this one included) make such names too: litter is what no
        # live process maps
        litter = {n for n in shm_names() - self.shm_before if n not in _mapped()}
        assert litter == set(), f"files left in /dev/shm: {litter}"
        with open(os.path.join(self.out, "losses.json")) as f:
            return json.load(f)


def train(out, *args, env=None, timeout=600.0) -> dict:
    return Job(out, *args, env=env).finish(timeout)


def newest_step(ckpt) -> str:
    from threefold.checkpoint.files import list_steps
    steps = list_steps(str(ckpt))
    return os.path.join(str(ckpt), steps[-1]) if steps else ""
