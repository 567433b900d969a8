"""A saved artifact trains in a fresh process that cannot import the model's source."""
import json
import os
import subprocess
import sys

import pytest

from tests.parity import load_workload, max_rel_diff, reference_losses

KW = {"n_layer": 3, "n_embd": 16, "n_head": 2, "seq": 8, "batch": 4}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_threefold_run_trains_a_saved_artifact_like_the_original(tmp_path):
    from threefold.codegen.artifact import save_artifact
    from threefold.compiler.api import compile_workload
    w = load_workload("gpt", **KW)
    prog = compile_workload(w, "pp=2,m=2")
    save_artifact(prog, str(tmp_path / "art"), batch=(*w["inputs"], w["target"]))
    ref = reference_losses("gpt", KW, 3)
    env = dict(os.environ, PYTHONPATH="")   # the repository (and examples/) is not importable
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(tmp_path / "art"), "--json"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=250)
    assert out.returncode == 0, out.stderr
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    assert max_rel_diff(losses, ref) < 1e-5, (losses, ref)


def test_run_rejects_a_directory_that_is_not_an_artifact(tmp_path):
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "not a threefold artifact" in out.stderr
    assert "Traceback" not in out.stderr
