"""bench/gpu_1b.py, the prepared GPU check of issue 12, in its CPU smoke mode."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _smoke(*flags) -> dict:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_1b.py"), "--smoke", "--json", *flags],
                         capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["failed"] == {}
    assert r["estimate_bytes"]["total"] > r["estimate_bytes"]["params"] > 0
    for row in r["rows"].values():
        assert row["tokens_per_s"] > 0 and row["model_tflops"] > 0
    return r["rows"]


def _same_first_loss(row: dict, eager: dict) -> bool:
    """The same weights and batch under bf16 autocast: the first losses agree to bf16 rounding."""
    return abs(row["first_loss"] - eager["first_loss"]) < 1e-2 * abs(eager["first_loss"])


@pytest.mark.timeout(300)
def test_gpu_1b_smoke_runs_threefold_and_eager_on_the_same_model():
    rows = _smoke("--no-compile")
    assert set(rows) == {"threefold recompute=selective", "eager autocast bf16"}
    assert _same_first_loss(rows["threefold recompute=selective"], rows["eager autocast bf16"])


@pytest.mark.slow   # Inductor's first C++ compile: a minute or more with an empty cache
@pytest.mark.timeout(600)
def test_gpu_1b_smoke_covers_the_inductor_backend():
    rows = _smoke()
    assert set(rows) == {"threefold recompute=selective", "threefold recompute=selective,compile=inductor",
                         "eager autocast bf16"}
    for name in rows:
        assert _same_first_loss(rows[name], rows["eager autocast bf16"]), name


def test_gpu_1b_without_a_gpu_says_so_and_exits_2():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_1b.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "Traceback" not in out.stderr
