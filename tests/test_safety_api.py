"""The API as documented: pm(x) on a loss-compiled model returns the model's outputs; parallelize under
torchrun joins the job from the environment; no temporary files are left behind."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import threefold
from threefold.errors import PlanError
from threefold.runtime.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TwoOut(Tiny):
    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h), h.sum()


def test_call_returns_outputs_with_and_without_a_loss():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(4, 8)
    pm = threefold.parallelize(model, "", (x,))
    out = pm(x)                  # a tensor, as the eager model returns
    assert torch.allclose(out, model(x), atol=1e-6)
    with_loss = threefold.parallelize(model, "m=2", (x,), torch.nn.functional.mse_loss, target=torch.zeros(4, 4))
    out = with_loss(x)           # the model's outputs, as eager gives them; no target needed
    assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-6)
    assert with_loss.evaluate(x, target=torch.zeros(4, 4)) == pytest.approx(float((model(x) ** 2).mean().detach()), rel=1e-5)


def test_call_names_an_output_the_loss_never_reads():
    torch.manual_seed(0)
    model, x = TwoOut(), torch.randn(4, 8)
    pm = threefold.parallelize(model, "", (x,), lambda out, y: torch.nn.functional.mse_loss(out[0], y),
                               target=torch.zeros(4, 4))
    with pytest.raises(PlanError, match="model output 1 is not read by the loss_fn"):
        pm(x)


TORCHRUN_JOB = textwrap.dedent('''
    import torch, torch.distributed as dist, threefold
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    pm = threefold.parallelize(model, "pp=2,m=2", (x,), torch.nn.functional.mse_loss, target=y)
    loss = pm.step(x, target=y)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} loss {loss:.6f}")
''')


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_parallelize_joins_a_torchrun_job_by_itself(tmp_path):
    (tmp_path / "job.py").write_text(TORCHRUN_JOB)
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path / "tmp"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--master-addr=127.0.0.1", f"--master-port={free_port()}", "job.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stderr[-3000:]
    # The two ranks share one stdout, so their lines may interleave: read the reports, not lines.
    reports = sorted(re.findall(r"rank (\d) of (\d) loss (\d+\.\d{6})", out.stdout))
    assert [(r, w) for r, w, _ in reports] == [("0", "2"), ("1", "2")], out.stdout
    assert len({loss for _, _, loss in reports}) == 1           # same loss on both ranks
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("threefold")]
