"""Issue 26, part B, on real multi-process runs (slow): one run per --out, the second named
and refused while the first trains; a resume drops what an interrupted save left; a killed
process group leaves no POSIX semaphores behind."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq", "16", "--batch", "4", "--plan", "pp=2,m=2",
        "--eval-every", "0", "--sample-tokens", "0"]


def _env(tmp):
    return dict(os.environ, PYTHONPATH=ROOT, THREEFOLD_CACHE_DIR=str(tmp / "cache"), OMP_NUM_THREADS="1")


def _train(tmp, *args):
    return [sys.executable, "-m", "threefold", "train", *TINY, *args]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_second_run_on_the_same_out_is_refused_and_a_resume_cleans_partial_saves(tmp_path):
    out, ck = tmp_path / "out", tmp_path / "out.ckpt"
    first = subprocess.Popen(_train(tmp_path, "--steps", "30", "--save-every", "10", "--out", str(out), "--seed", "1"),
                             cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        lock = tmp_path / ".out.lock"
        deadline = time.monotonic() + 120
        while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lock.exists(), first.communicate()
        second = subprocess.run(_train(tmp_path, "--steps", "30", "--save-every", "5", "--out", str(out),
                                       "--seed", "2"), cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                                text=True, timeout=120)
        lines = [x for x in second.stderr.splitlines() if x.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"in use by another threefold run (pid {first.pid})" in lines[0], lines
        assert first.poll() is None                         # the first run was not disturbed
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
    assert (out / "losses.json").exists() and '"plan"' in (out / "losses.json").read_text()
    assert sorted(n for n in os.listdir(ck) if n.startswith("step_")) == ["step_000000020", "step_000000030"]
    assert not lock.exists()
    partial = ck / ".tmp-step_000000040-killed"          # what a save killed mid-way leaves
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    resumed = subprocess.run(_train(tmp_path, "--steps", "32", "--save-every", "100", "--out", str(out),
                                    "--seed", "1", "--resume"), cwd=tmp_path, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and not partial.exists()


HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from threefold.runtime.launch import launch

def wait():
    time.sleep(120)

if __name__ == "__main__":
    launch(wait, 2)
"""


def _tree(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_a_killed_job_leaves_no_semaphores(tmp_path):
    """Named semaphores are files under /dev/shm mapped into the processes that use them;
    the launcher and its ranks map none, so SIGKILL to the whole group leaves none behind."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD.format(root=ROOT))
    job = subprocess.Popen([sys.executable, str(script)], env=_env(tmp_path), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(_tree(job.pid)) < 4:     # launcher, tracker, 2 ranks
            time.sleep(0.2)
        time.sleep(2.0)                                    # the ranks are in the rendezvous or sleeping
        procs = _tree(job.pid)
        assert len(procs) >= 3, procs
        mapped = []
        for p in procs:
            try:
                with open(f"/proc/{p}/maps") as f:
                    mapped += [line.split()[-1] for line in f if "/dev/shm/sem." in line]
            except OSError:
                pass
        assert not mapped, mapped
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
