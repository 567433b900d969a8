"""`threefold train --max-restarts`: a job whose ranks die or stop restarts itself from the
newest checkpoint and finishes with the losses of a run that never failed (same world: bit
for bit), or of a run resumed by hand on the plan derived for fewer ranks; the restart is in
the record; no process or /dev/shm file outlives the job."""
import random
import shutil
import signal
import time

import pytest

from tests.elastic_job import Job, newest_step, ranks_of, train
from tests.parity import max_rel_diff

RESTARTING = r"restarting from (\S+)"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_rank_restarts_on_the_same_world_bit_for_bit(tmp_path):
    common = ["--plan", "pp=2,m=2", "--steps", "16"]
    reference = train(tmp_path / "ref", *common)["losses"]
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path / "run", *common, "--save-every", "4", "--ckpt-dir", str(ckpt), "--max-restarts", "1")
    job.wait_for(lambda: newest_step(ckpt).endswith("step_000000008"))
    killed_at = job.signal_rank(1, signal.SIGKILL)
    got = job.finish()
    assert got["losses"] == reference            # bit for bit
    (restart,) = got["restarts"]
    assert restart["old_plan"] == restart["new_plan"] and restart["new_world"] == 2
    assert 8 <= restart["step"] <= 16 and restart["resumed_at"] > killed_at
    assert 0 <= restart["steps_lost"] <= 4, restart          # at most the checkpoint interval
    assert "rank" in restart["cause"] and "died" in restart["cause"], restart


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_kill_during_a_background_write_loses_at_most_the_interval(tmp_path):
    """The save of step 8 is staged in /dev/shm (checkpoint/staging.py) and sealed by both
    ranks; a rank killed while it is written: the restart commits it and resumes at step 8
    (in memory only, the job fell back to step 4), with the uninterrupted run's losses."""
    import os

    from threefold.checkpoint.staging import stage_dir
    common = ["--plan", "pp=2,m=2", "--steps", "16"]
    reference = train(tmp_path / "ref", *common)["losses"]
    ckpt = tmp_path / "ckpt"
    staged = [os.path.join(stage_dir(str(ckpt)), f"step_000000008.rank_{r}.json") for r in (0, 1)]
    job = Job(tmp_path / "run", *common, "--save-every", "4", "--ckpt-dir", str(ckpt), "--max-restarts", "1")
    job.wait_for(lambda: all(os.path.exists(p) for p in staged), timeout=600)
    job.signal_rank(1, signal.SIGKILL)
    published = newest_step(ckpt).endswith("step_000000008")     # the write may have won the race
    used = job.wait_for(RESTARTING).group(1)
    got = job.finish()
    assert used.endswith("step_000000008"), used      # the resumed step: the staged save's
    if not published:
        assert any("committed from the snapshot staged" in line for line in job.lines), job.lines[-5:]
    assert got["losses"] == reference            # bit for bit
    (restart,) = got["restarts"]
    assert restart["step"] == 8 and 0 <= restart["steps_lost"] <= 4, restart


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_that_fails_mid_write_commits_the_staged_save_and_leaves_nothing_in_dev_shm(tmp_path):
    """Without --max-restarts a rank killed during the background write of step 8 fails the
    job; the parent still commits the sealed save, so a hand resume starts at step 8."""
    import os

    from threefold.checkpoint import files, reader
    from threefold.checkpoint.staging import stage_dir
    ckpt = tmp_path / "ckpt"
    staged = [os.path.join(stage_dir(str(ckpt)), f"step_000000008.rank_{r}.json") for r in (0, 1)]
    job = Job(tmp_path / "run", "--plan", "pp=2,m=2", "--steps", "16", "--save-every", "4", "--ckpt-dir", str(ckpt))
    job.wait_for(lambda: all(os.path.exists(p) for p in staged), timeout=600)
    job.signal_rank(1, signal.SIGKILL)
    job.proc.communicate(timeout=300)
    assert job.proc.returncode != 0
    assert reader.resolve(str(ckpt)).endswith("step_000000008"), files.list_steps(str(ckpt))
    reader.read_index(reader.resolve(str(ckpt)))            # the restricted reader accepts it
    assert not os.path.exists(stage_dir(str(ckpt)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stopped_rank_is_restarted_like_a_dead_one(tmp_path):
    common = ["--plan", "pp=2,m=2", "--steps", "12"]
    reference = train(tmp_path / "ref", *common)["losses"]
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path / "run", *common, "--save-every", "4", "--ckpt-dir", str(ckpt), "--max-restarts", "1",
              env={"THREEFOLD_TIMEOUT": "40"})
    job.wait_for(lambda: newest_step(ckpt).endswith("step_000000004"))
    job.signal_rank(0, signal.SIGSTOP)
    job.wait_for(RESTARTING, timeout=120)          # within the bound
    got = job.finish()
    assert got["losses"] == reference
    assert "stopped" in got["restarts"][0]["cause"], got["restarts"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restart_on_fewer_ranks_equals_a_hand_resume_on_the_derived_plan(tmp_path):
    common = ["--plan", "pp=2,dp=2,m=2", "--steps", "12"]
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path / "run", *common, "--save-every", "4", "--ckpt-dir", str(ckpt), "--max-restarts", "1",
              "--min-world", "2", env={"THREEFOLD_ELASTIC_DROP_DEAD": "1"})
    job.wait_for(lambda: newest_step(ckpt).endswith("step_000000004"))
    job.signal_rank(3, signal.SIGKILL)
    used = job.wait_for(RESTARTING).group(1)
    kept = tmp_path / "kept"
    shutil.copytree(used, kept)                   # before the restarted job's saves replace it
    got = job.finish()
    (restart,) = got["restarts"]
    assert restart["old_world"] == 4 and restart["new_world"] == 2
    assert restart["new_plan"].startswith("tp=1,pp=2,dp=1,m=4"), restart   # dp halved, m doubled
    by_hand = train(tmp_path / "hand", "--plan", restart["new_plan"], "--steps", "12", "--resume", str(kept),
                    "--ckpt-dir", str(tmp_path / "hand.ckpt"))
    assert len(got["losses"]) == len(by_hand["losses"]) == 12
    assert max_rel_diff(got["losses"], by_hand["losses"]) < 1e-5, (got["losses"], by_hand["losses"])


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_soak_four_ranks_killed_at_five_random_points(tmp_path):
    """Kills at random ranks and moments, some during a save or a restart: the job still
    ends with the uninterrupted run's losses, bit for bit, and leaves nothing behind."""
    rnd = random.Random(43)
    # long enough that every kill lands before the job ends, however quick the ranks start
    # (60 steps ended before the fifth kill on a quiet machine once ranks came from a forkserver)
    common = ["--plan", "pp=2,dp=2,m=2", "--steps", "120"]
    reference = train(tmp_path / "ref", *common)["losses"]
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path / "run", *common, "--save-every", "3", "--ckpt-dir", str(ckpt), "--max-restarts", "5")
    restarts = lambda: sum("restarting from" in line for line in job.lines)   # noqa: E731
    for kill in range(5):
        # after the previous restart began: some kills land while the ranks start or resume,
        # some mid-step, some during a background save
        job.wait_for(lambda k=kill: restarts() >= k and len(ranks_of(job.proc.pid)) == 4, timeout=600)
        time.sleep(rnd.uniform(0.0, 3.0))
        job.signal_rank(rnd.randrange(4), signal.SIGKILL)
        job.wait_for(lambda k=kill: restarts() > k, timeout=600)
    got = job.finish(timeout=1500)
    assert got["losses"] == reference
    assert len(got["restarts"]) >= 1


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_torchrun_agent_restarts_resume_the_newest_checkpoint_bit_for_bit(tmp_path):
    """Under `torchrun --max-restarts 1` the agent restarts every process after a kill; each
    resumes the newest checkpoint by itself (TORCHELASTIC_RESTART_COUNT) and records it."""
    import json
    import os
    import subprocess
    import sys

    from tests.elastic_job import SMALL, descendants
    from tests.parity import ROOT
    common = ["--plan", "pp=2,m=2", "--steps", "16"]
    reference = train(tmp_path / "ref", *common)["losses"]
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "--max-restarts", "1", "-m", "threefold", "train", *SMALL, *common, "--out",
                              str(tmp_path / "run"), "--save-every", "4", "--ckpt-dir", str(ckpt)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not newest_step(ckpt).endswith("step_000000008"):
        assert agent.poll() is None and time.monotonic() < deadline, "no checkpoint at step 8"
        time.sleep(0.05)
    workers = [p for p in descendants(agent.pid) if _is_threefold(p)]
    os.kill(max(workers), signal.SIGKILL)
    out, err = agent.communicate(timeout=900)
    assert agent.returncode == 0, err[-3000:]
    with open(tmp_path / "run" / "losses.json") as f:
        got = json.load(f)
    assert got["losses"] == reference
    assert got["restarts"] and "torchrun" in got["restarts"][0]["cause"], got["restarts"]


def _is_threefold(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return b"threefold" in args and b"torch.distributed.run" not in args


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_where_the_shape_must_change_the_planners_pick_equals_a_hand_resume_on_it(tmp_path):
    """tp=2,pp=2 losing a rank: no dp fits 3 ranks, so the shape changes on 2; the planner
    picks among every smaller cut (train/elastic_plan.planner_order: plain dp for this small
    model, where the fixed order took tp=2,pp=1), prints why, and the run equals a hand
    resume of the same checkpoint on that plan."""
    common = ["--plan", "tp=2,pp=2,m=2", "--steps", "8"]
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path / "run", *common, "--save-every", "4", "--ckpt-dir", str(ckpt), "--max-restarts", "1",
              "--min-world", "2", env={"THREEFOLD_ELASTIC_DROP_DEAD": "1"})
    job.wait_for(lambda: newest_step(ckpt).endswith("step_000000004"))
    job.signal_rank(2, signal.SIGKILL)
    line = job.wait_for(r"restarting from (\S+) .*the planner's pick")
    kept = tmp_path / "kept"
    shutil.copytree(line.group(1), kept)
    got = job.finish()
    (restart,) = got["restarts"]
    assert restart["new_world"] == 2 and restart["new_plan"].startswith("tp=1,pp=1,dp=2"), restart
    by_hand = train(tmp_path / "hand", "--plan", restart["new_plan"], "--steps", "8", "--resume", str(kept),
                    "--ckpt-dir", str(tmp_path / "hand.ckpt"))
    assert len(got["losses"]) == len(by_hand["losses"]) == 8
    assert max_rel_diff(got["losses"], by_hand["losses"]) < 1e-5, (got["losses"], by_hand["losses"])
