"""Smoke test: bench/pipeline_bubbles.py runs at tiny size and every contender reports the same loss."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_bubbles_bench_runs_quick():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pipeline_bubbles.py"), "--quick",
                          "--ms", "2", "--iters", "1", "--warmup", "0", "--json"],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout)
    row = s["rows"]["2"]
    names = set(row["contenders"])
    assert {"threefold 1f1b", "threefold interleaved", "torch Schedule1F1B"} <= names, names
    losses = {n: c["loss"] for n, c in row["contenders"].items()}
    first = next(iter(losses.values()))
    assert all(abs(x - first) <= 1e-5 * abs(first) for x in losses.values()), losses
    for n, c in row["contenders"].items():
        assert 0.0 <= c["bubble_measured"] < 1.0, (n, c)
        assert c["vs_limit_paired"] > 0, (n, c)
        assert c["faults_per_step"] >= 0, (n, c)
