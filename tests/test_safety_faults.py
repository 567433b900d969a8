"""Bounded faults: a dead or stopped rank (rank 0 included), or a killed launcher, ends the
whole pp=2, tp=2, dp=2 job within THREEFOLD_TIMEOUT + 10 s, naming the rank, leaving no
process behind (tests/safety_fault_job.py is the job)."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "safety_fault_job.py")
TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 10


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pids(piddir) -> list[int]:
    return [int((piddir / f"rank{r}").read_text()) for r in range(8) if (piddir / f"rank{r}").exists()]


def _start(piddir, victim: int, sig: str):
    env = dict(os.environ, THREEFOLD_TIMEOUT=str(TIMEOUT_S))
    return subprocess.Popen([sys.executable, JOB, str(piddir), str(victim), sig], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_ranks(piddir, proc, n: int = 8, limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    while len(_rank_pids(piddir)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "ranks did not start"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim", [0, 5])
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_stopped_rank_ends_the_job_in_bounded_time(tmp_path, victim, sig):
    proc = _start(tmp_path, victim, sig)
    out, err = proc.communicate(timeout=180)
    ended = time.time()
    assert proc.returncode == 3, (out, err)
    seconds = ended - float((tmp_path / "fault").read_text())
    assert seconds < BOUND_S, (seconds, err)
    first = err.splitlines()[1]
    assert f"rank {victim}: rank {victim} " in first and ("died" in first or "stopped" in first), err
    assert "rank -1" not in err
    left = [p for p in _rank_pids(tmp_path) if _alive(p)]
    assert not left, f"orphans: {left}"


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path, how):
    proc = _start(tmp_path, -1, "SIGKILL")
    _wait_for_ranks(tmp_path, proc)
    pids = _rank_pids(tmp_path)
    start = time.monotonic()
    proc.send_signal(getattr(signal, how))
    out, err = proc.communicate(timeout=60)
    if how == "SIGTERM":
        assert proc.returncode == 143 and "SIGTERM" in err, (proc.returncode, err)
    end = time.monotonic() + BOUND_S
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "orphans left"
    assert time.monotonic() - start < BOUND_S
