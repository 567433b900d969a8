"""What a plan text leaves out is filled in by one rule (threefold/plan_defaults.py): m = 2*pp
for a pipeline (lowered, with a note, to the largest value dividing the batch), dp from the
job's world size; what the text gives is never changed."""
from __future__ import annotations

import pytest
import torch

from threefold import Plan, PlanError
from threefold.plan_defaults import batch_rows, resolve_plan


def test_a_pipeline_without_m_pipelines():
    plan = resolve_plan("tp=2,pp=2").plan          # the case: was m=1, no pipelining
    assert (plan.tp, plan.pp, plan.microbatches) == (2, 2, 4)
    assert resolve_plan("pp=4,v=2,schedule=interleaved").plan.microbatches == 8
    assert resolve_plan("tp=2").plan.microbatches == 1           # no pipeline: nothing to overlap
    assert resolve_plan("pp=2,m=1").plan.microbatches == 1       # given: kept, even m=1
    explicit = Plan(pp=2)
    assert resolve_plan(explicit).plan is explicit               # a Plan value is used as built


def test_default_m_is_lowered_to_divide_the_batch_and_says_so():
    r = resolve_plan("pp=2", batch=6)
    assert r.plan.microbatches == 3 and "m=3" in r.notes[0] and "6 rows" in r.notes[0]
    assert resolve_plan("pp=2", batch=8).notes == ()
    r = resolve_plan("pp=2", world=4, batch=6)                   # dp=2: 3 rows per replica
    assert (r.plan.dp, r.plan.microbatches) == (2, 3)


def test_dp_comes_from_the_world_size_when_not_given():
    assert resolve_plan("pp=2", world=4).plan.dp == 2            # was an error
    assert resolve_plan("tp=2,pp=2", world=8).plan.dp == 2
    assert resolve_plan("", world=3).plan.dp == 3
    assert resolve_plan("pp=2,dp=1", world=4).plan.dp == 1        # given: the world check says why
    assert resolve_plan("pp=2", world=3).plan.dp == 1             # does not divide: same
    hsdp = resolve_plan("tp=2,zero=3,dp_shard=2", world=8).plan      # dp = 4, sharded over 2 of them
    assert (hsdp.dp, hsdp.shard_degree) == (4, 2)


def test_an_explicit_m_that_does_not_divide_the_batch_stays_an_error(tmp_path, capsys):
    from threefold.cli.main import main
    spec = tmp_path / "six_rows.py"
    spec.write_text("import torch\n"
                    "def workload():\n"
                    "    torch.manual_seed(0)\n"
                    "    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n"
                    "    return {'model': model, 'inputs': (torch.randn(6, 4),)}\n")
    assert main(["inspect", f"{spec}:workload", "--plan", "pp=2", "--json"]) == 0   # default m: 3 for 6 rows
    out = capsys.readouterr()
    assert '"plan": "tp=1,pp=2,dp=1,m=3' in out.out and "m=3: the default m=2*pp=4" in out.err
    assert main(["inspect", f"{spec}:workload", "--plan", "pp=2,m=4"]) == 2
    assert "divisible by dp*m=4" in capsys.readouterr().err


def test_batch_rows_reads_the_declared_batch_dim():
    x, t = torch.zeros(3, 8), torch.zeros(8, 3)
    assert batch_rows((x,)) == 3
    assert batch_rows((x, t), [1, 0]) == 8
    assert batch_rows((torch.zeros(()), t), [None, 0]) == 8


def test_commands_take_dp_from_torchruns_world(monkeypatch, capsys):
    from threefold.cli.jobs import command_plan, tell
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    resolved = command_plan("pp=2", batch=6)
    assert (resolved.plan.pp, resolved.plan.dp, resolved.plan.microbatches) == (2, 2, 3)
    tell(resolved)
    assert "m=3" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    assert command_plan("pp=2").plan.dp == 1                      # a local run starts tp*pp*dp ranks


def _parallel_loss(plan_text):
    import threefold
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    pm = threefold.parallelize(model, plan_text, (x,), torch.nn.functional.mse_loss, target=y)
    reference = float(torch.nn.functional.mse_loss(model(x), y))
    return str(pm.plan), pm.step(x, target=y), reference


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parallelize_on_4_ranks_infers_dp_and_m():
    from threefold.runtime.launch import launch
    results = launch(_parallel_loss, 4, "pp=2", timeout=280)
    plans = {r[0] for r in results}
    assert plans == {str(Plan(pp=2, dp=2, microbatches=4))}
    for _, loss, reference in results:
        assert loss == pytest.approx(reference, rel=1e-5)
