"""The runtime's public surface: layering, decorator use, forward-only inference, CLI jobs."""
import json
import os
import subprocess
import sys

import pytest
import torch

import threefold
from threefold.runtime.launch import launch
from tests.parity import load_workload, max_rel_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KW = {"n_layer": 2, "n_embd": 16, "n_head": 2, "seq": 8, "batch": 4}


def test_runtime_imports_nothing_from_the_compiler():
    code = ("import sys, pkgutil, importlib, threefold.runtime as r\n"
            "for m in pkgutil.iter_modules(r.__path__): importlib.import_module('threefold.runtime.' + m.name)\n"
            "bad = [m for m in sys.modules if m.startswith(('threefold.compiler', 'threefold.passes', 'threefold.codegen'))]\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _decorated_and_inference():
    from tests.parity import load_workload
    torch.set_num_threads(1)
    w = load_workload("gpt", **KW)

    @threefold.parallelize(plan="pp=2,m=2", example_inputs=w["inputs"], loss_fn=w["loss_fn"],
                           target=w["target"])
    def build():
        return w["model"]

    pm = build()
    before = pm.evaluate(*w["inputs"], target=w["target"])   # forward only: no gradients
    assert all(p.grad is None for p in pm.parameters())
    loss = pm.step(*w["inputs"], target=w["target"])
    return before, loss, dict(pm.named_parameters()).keys().__len__()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_decorator_builds_a_parallel_module_and_evaluate_is_forward_only():
    w = load_workload("gpt", **KW)
    with torch.no_grad():
        expected = w["loss_fn"](w["model"](*w["inputs"]), w["target"]).item()
    results = launch(_decorated_and_inference, 2, timeout=180)
    for before, loss, nparams in results:
        assert abs(before - expected) / expected < 1e-6
        assert abs(loss - expected) / expected < 1e-6     # the step's loss is before the update
        assert nparams > 0


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_check_command_agrees_and_reports_json():
    out = subprocess.run([sys.executable, "-m", "threefold", "check", "examples/gpt.py:workload(n_layer=2)",
                          "--plan", "pp=2,dp=1,m=2", "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"plan", "losses_parallel", "losses_reference", "max_rel_diff", "ok",
                           "compares", "loss_noise_std"}
    assert report["compares"] == "exact"   # the example has no random ops
    assert report["ok"] and len(report["losses_parallel"]) == 3
    assert max_rel_diff(report["losses_parallel"], report["losses_reference"]) <= 1e-5


def test_check_command_bad_plan_is_exit_2():
    out = subprocess.run([sys.executable, "-m", "threefold", "check", "examples/gpt.py:workload",
                          "--plan", "pp=2,bogus=1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "bogus" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_train_main_job_runs_and_writes_its_loss_curve(tmp_path):
    out_dir = tmp_path / "run"      # not the current directory itself: that one is refused
    out = subprocess.run([sys.executable, "-m", "threefold", "train", "--steps", "8", "--json",
                          "--out", str(out_dir)], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["final_loss"] < summary["first_loss"]
    assert summary["tokens_per_second"] > 0
    assert os.path.getsize(out_dir / "loss.png") > 1000
    assert len(json.load(open(out_dir / "losses.json"))["losses"]) == 8
