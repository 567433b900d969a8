"""threefold train --save-every / --resume: a run whose rank is killed mid-run resumes from
its last checkpoint and reproduces the uninterrupted run's losses."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.parity import ROOT, max_rel_diff

COMMON = ["--plan", "pp=2,m=2", "--batch", "4", "--seq", "16", "--steps", "60", "--json"]


def _train(out_dir, *extra, timeout=240):
    out = subprocess.run([sys.executable, "-m", "threefold", "train", *COMMON, "--out", str(out_dir), *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    with open(os.path.join(out_dir, "losses.json")) as f:
        return json.load(f), out.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_run_resumes_and_reproduces_the_losses(tmp_path):
    reference = _train(tmp_path / "ref")[0]["losses"]
    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen([sys.executable, "-m", "threefold", "train", *COMMON, "--out", str(tmp_path / "run"),
                            "--save-every", "3", "--ckpt-dir", str(ckpt)], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (ckpt / "step_000000006" / "threefold.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint at step 6"
        time.sleep(0.05)
    from tests.elastic_job import ranks_of
    victim = max(ranks_of(job.pid))              # the newest rank
    os.kill(victim, signal.SIGKILL)
    assert job.wait(timeout=120) != 0, "the run finished before the kill: nothing to resume"
    resumed, err = _train(tmp_path / "run2", "--ckpt-dir", str(ckpt), "--resume")
    import re
    at = re.search(r"resumed from \S+ at step (\d+)", err)
    assert at and 6 <= int(at.group(1)) < 60, err[-500:]
    assert len(resumed["losses"]) == len(reference) == 60
    assert max_rel_diff(resumed["losses"], reference) < 1e-6, (resumed["losses"], reference)


def test_resume_from_a_directory_that_is_not_a_checkpoint_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "threefold", "train", "--steps", "1", "--out", str(tmp_path / "o"),
                          "--resume", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a threefold checkpoint" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def _run(*args):
    out = subprocess.run([sys.executable, "-m", "threefold", "run", *args, "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)["losses"], out.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_artifact_saves_and_resumes(tmp_path):
    art = tmp_path / "art"
    out = subprocess.run([sys.executable, "-m", "threefold", "compile", "examples/gpt.py:workload(n_layer=2)",
                          "--plan", "pp=2", "--out", str(art)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    reference, _ = _run(str(art), "--steps", "6")
    first, _ = _run(str(art), "--steps", "4", "--save-every", "2", "--ckpt-dir", str(tmp_path / "c"))
    resumed, err = _run(str(art), "--steps", "6", "--ckpt-dir", str(tmp_path / "c"), "--resume")
    assert "resumed from" in err and "at step 4" in err, err[-500:]
    assert first == reference[:4]
    assert len(resumed) == 6 and max_rel_diff(resumed, reference) < 1e-6, (resumed, reference)
    assert sorted(os.listdir(tmp_path / "c"))[-2:] == ["step_000000002", "step_000000004"]
