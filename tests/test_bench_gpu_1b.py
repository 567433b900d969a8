"""bench/gpu_1b.py, the prepared GPU check of issue 12, in its CPU smoke mode."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_gpu_1b_smoke_runs_threefold_and_eager_on_the_same_model():
    """Also threefold's compile=inductor backend (C++ here; a first compile on a loaded
    2-core machine takes a minute or more)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_1b.py"), "--smoke", "--json"],
                         capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    rows = r["rows"]
    assert r["failed"] == {}
    assert set(rows) == {"threefold recompute=selective", "threefold recompute=selective,compile=inductor",
                         "eager autocast bf16"}
    assert r["estimate_bytes"]["total"] > r["estimate_bytes"]["params"] > 0
    ours, eager = rows["threefold recompute=selective"], rows["eager autocast bf16"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["model_tflops"] > 0
    # the same weights and batch under bf16 autocast: the first losses agree to bf16 rounding
    assert abs(ours["first_loss"] - eager["first_loss"]) < 1e-2 * abs(eager["first_loss"])
    inductor = rows["threefold recompute=selective,compile=inductor"]
    assert abs(inductor["first_loss"] - eager["first_loss"]) < 1e-2 * abs(eager["first_loss"])


def test_gpu_1b_without_a_gpu_says_so_and_exits_2():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_1b.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "Traceback" not in out.stderr
