"""A compiled MoE artifact runs under `threefold run`: the custom grouped-matmul op its
generated code calls is registered by the module the manifest names (transformers' own,
or the user's), checked against its sha256 and imported before the chunk modules."""
import json
import os
import subprocess
import sys

import pytest
import torch

import threefold
from tests.parity import max_rel_diff, sgd_losses


def _save(tmp_path, arch: str, plan: str) -> str:
    from tests.zoo import ZOO
    from threefold.codegen.artifact import save_artifact
    from threefold.compiler.api import compile_workload
    torch.manual_seed(1234)
    w = ZOO[arch]()
    out = str(tmp_path / arch)
    save_artifact(compile_workload(w, plan), out, batch=(*w["inputs"], w["target"]))
    return out


def _run(tmp_path, art: str) -> subprocess.CompletedProcess:
    # only this checkout's threefold is importable: not tests/ (the models' source)
    only = tmp_path / "only"
    only.mkdir(exist_ok=True)
    if not (only / "threefold").exists():
        os.symlink(os.path.dirname(threefold.__file__), only / "threefold")
    env = dict(os.environ, PYTHONPATH=str(only))
    return subprocess.run([sys.executable, "-m", "threefold", "run", art, "--json"], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mixtral_artifact_at_ep2_runs_like_one_process_and_a_users_op_module_must_be_importable(tmp_path):
    from tests.zoo import ZOO
    from threefold.runtime.loader import open_artifact
    art = _save(tmp_path, "mixtral", "dp=2,ep=2")
    assert open_artifact(art).manifest.op_modules["transformers::grouped_mm_fallback"]["module"] \
        == "transformers.integrations.moe"
    torch.manual_seed(1234)
    ref = sgd_losses(ZOO["mixtral"](), 3)
    out = _run(tmp_path, art)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    assert max_rel_diff(losses, ref) < 1e-5, (losses, ref)
    # the hand-written MoE's op lives in its own source, which this process cannot import:
    # one line before any rank starts, naming the op, the module and the fix
    hw = _save(tmp_path, "hw_moe_top2", "dp=2,ep=2")
    out = _run(tmp_path, hw)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "calls op zoo_moe::gmm, registered by module 'tests.zoo.handwritten_moe', which this " \
           "process cannot import" in out.stderr


def test_a_changed_op_module_is_refused(tmp_path):
    import tests.zoo.handwritten_moe  # noqa: F401 (registers zoo_moe::gmm here)
    from threefold.runtime.op_modules import check_op_modules
    entry = {"module": "tests.zoo.handwritten_moe", "sha256": "0" * 64}
    assert check_op_modules({"zoo_moe::gmm": entry}, "A") == []       # registered here already
    with pytest.raises(threefold.PlanError, match="changed since compile"):
        check_op_modules({"nosuchns::gmm": entry}, "A")
    with pytest.raises(threefold.PlanError, match="cannot import"):
        check_op_modules({"nosuchns::gmm": {"module": "no_such_module_x", "sha256": "0" * 64}}, "A")
