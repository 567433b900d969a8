"""Locks and ownership of checkpoint folders (issue 45 item 3): locks keyed by the resolved
path and held by --resume; a run prunes, replaces and points `latest` at its own
checkpoints only; a --ckpt-dir of a user's files or an earlier run's checkpoints is refused
unless --force (a user's `latest` moved aside, never overwritten); --resume refuses another
run's checkpoint; another run's save in progress is never dropped."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from threefold import PlanError
from threefold.checkpoint import files, ownership
from threefold.cli.main import main
from threefold.dir_lock import dir_lock

TRAIN = ["train", "--steps", "2", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq", "8",
         "--batch", "4", "--eval-every", "0", "--sample-tokens", "0", "--plan", "tp=1"]


def _fake_step(root, step: int, run_id: str | None) -> str:
    path = os.path.join(root, files.step_name(step))
    os.makedirs(path)
    index = {"format": files.FORMAT, "step": step, "files": {}}
    if run_id:
        index["run"] = {"id": run_id}
    with open(os.path.join(path, files.INDEX), "w") as f:
        json.dump(index, f)
    return path


def test_a_symlink_to_a_locked_directory_is_the_same_lock(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with dir_lock(str(tmp_path / "real"), "--ckpt-dir"):
        import subprocess
        import sys
        code = ("import sys; from threefold.dir_lock import dir_lock\n"
                "try:\n    dir_lock(sys.argv[1], '--ckpt-dir').__enter__()\nexcept Exception as e:\n"
                "    print(e); sys.exit(2)\n")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "link")], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert out.returncode == 2 and "in use by another threefold run" in out.stdout, out


def test_publish_prunes_and_replaces_only_its_own_runs_checkpoints(tmp_path):
    root = str(tmp_path)
    for step in (2, 4, 6, 8):
        _fake_step(root, step, "aaaa")
    for step in (2, 4):       # a second, shorter run into the same folder
        tmp = os.path.join(root, f".tmp-{files.step_name(step)}-x")
        os.makedirs(tmp)
        with open(os.path.join(tmp, files.INDEX), "w") as f:
            json.dump({"format": files.FORMAT, "step": step, "files": {}, "run": {"id": "bbbb"}}, f)
        files.publish(root, tmp, files.step_name(step), keep=1, run_id="bbbb")
    names = sorted(os.listdir(root))
    # B kept its newest (step 4) and points latest at it; A's steps are all kept, the two
    # of the same name set aside under A's id
    assert open(os.path.join(root, files.LATEST)).read().strip() == files.step_name(4)
    assert files.run_id_of(os.path.join(root, files.step_name(4))) == "bbbb"
    assert f"{files.step_name(2)}.run-aaaa" in names and f"{files.step_name(4)}.run-aaaa" in names
    assert files.step_name(2) not in names          # B's own older step pruned
    assert {files.run_id_of(os.path.join(root, files.step_name(s))) for s in (6, 8)} == {"aaaa"}


def test_another_runs_save_in_progress_is_never_dropped(tmp_path):
    tmp = tmp_path / ".tmp-step_000000003-abc"
    tmp.mkdir()
    fd = files.hold_partial(str(tmp))
    try:
        assert files.drop_partial(str(tmp_path)) == [] and tmp.is_dir()
    finally:
        os.close(fd)
    assert files.drop_partial(str(tmp_path)) == [tmp.name]


def test_resume_of_another_runs_checkpoint_is_refused():
    class Cfg:
        seed, data, tokenizer, spec, batch, seq, plan = 1, None, "byte", None, 4, 8, "tp=1"
    record = ownership.run_record(Cfg)
    ownership.check_same_run("ck", {"run": dict(record)}, record)       # the same run: fine
    with pytest.raises(PlanError, match="another run's \\(seed 7"):
        ownership.check_same_run("ck", {"run": {**record, "seed": 7}}, record)
    assert ownership.run_record(Cfg, {"run": {"id": "kept"}})["id"] == "kept"


def _one_line(argv, capsys, *words):
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(w in err for w in words), err


def test_a_ckpt_dir_of_user_files_or_an_earlier_run_is_refused_without_force(tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me\n")
    (user / "latest").write_text("my own notes\n")
    _one_line([*TRAIN, "--save-every", "1", "--ckpt-dir", str(user), "--out", str(tmp_path / "o1")], capsys,
              "holds files threefold did not write", "--force")
    assert (user / "latest").read_text() == "my own notes\n" and (user / "notes.txt").exists()
    earlier = tmp_path / "earlier"
    _fake_step(str(earlier), 6, "aaaa")
    _one_line([*TRAIN, "--save-every", "1", "--ckpt-dir", str(earlier), "--out", str(tmp_path / "o2")], capsys,
              "earlier run's checkpoints", "--resume")
    moved = ownership.check_ckpt_dir(str(user), True, None, {"id": "new"})     # --force: moved aside
    assert moved.startswith("latest.moved-aside-") and (user / moved).read_text() == "my own notes\n"
    assert not (user / "latest").exists() and (user / "notes.txt").read_text() == "keep me\n"


class _OtherRun:
    """Another process's lock on a folder (dir_lock is re-entrant within one process: a
    second open file description's flock is what another run holds)."""

    def __init__(self, path):
        from threefold.dir_lock import lock_path
        self.lock = lock_path(path)

    def __enter__(self):
        import fcntl
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)
        os.unlink(self.lock)


def test_resume_while_another_run_writes_the_folder_is_refused(tmp_path, capsys):
    from tests.test_safety_checkpoint_data import _save
    root = tmp_path / "root"
    _save(str(root), {})
    with _OtherRun(str(root)):
        _one_line([*TRAIN, "--resume", str(root), "--out", str(tmp_path / "o")], capsys, "in use")
    link = tmp_path / "link"
    os.symlink(root, link)
    with _OtherRun(str(link)):          # the writer reached the same folder through a symlink
        _one_line([*TRAIN, "--resume", str(root), "--out", str(tmp_path / "o")], capsys, "in use")
    with _OtherRun(str(root)):
        _one_line([*TRAIN, "--resume", str(link), "--out", str(tmp_path / "o")], capsys, "in use")


def test_a_file_the_user_edited_in_a_threefold_out_dir_is_moved_aside_never_deleted(tmp_path):
    from threefold.outdir import check_out_dir, write_out_dir
    out = tmp_path / "out"

    def fill(tmp):
        with open(os.path.join(tmp, "losses.json"), "w") as f:
            f.write("[1]\n")
    write_out_dir(str(out), fill, kind="train")
    assert write_out_dir(str(out), fill, kind="train") is None     # ours, unchanged: replaced
    with open(out / "losses.json", "a") as f:
        f.write("my note\n")                                        # the user edits a listed file
    with pytest.raises(PlanError):
        check_out_dir(str(out), force=False)                        # no longer threefold's alone
    moved = write_out_dir(str(out), fill, kind="train", force=True)
    assert moved and open(moved + "/losses.json").read() == "[1]\nmy note\n"
    assert (out / "losses.json").read_text() == "[1]\n"


def test_sigterm_while_writing_the_out_dir_leaves_no_temporary(tmp_path):
    import signal
    from threefold.errors import Terminated
    from threefold.outdir import write_out_dir

    def fill(tmp):
        with open(os.path.join(tmp, "a.txt"), "w") as f:
            f.write("x")
        os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Terminated):
        write_out_dir(str(tmp_path / "out"), fill, kind="train")
    assert sorted(os.listdir(tmp_path)) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_a_full_disk_on_a_rank_is_one_line(monkeypatch):
    from threefold.cli import jobs
    from threefold.runtime import launch as launch_mod

    def full(*a, **k):
        err = launch_mod.LaunchError("rank 1 failed")
        err.errors = {1: "OSError: [Errno 28] No space left on device: '/x/metrics.jsonl'\nTraceback ...\n"}
        raise err
    monkeypatch.setattr(launch_mod, "launch", full)
    monkeypatch.setattr(jobs, "check_local_capacity", lambda w: None)
    with pytest.raises(PlanError, match="rank 1: the disk is full") as e:
        jobs.run_on_ranks(print, 2)
    assert "\n" not in str(e.value)


def test_sigterm_during_a_checkpoints_final_write_leaves_no_temporary(tmp_path, monkeypatch):
    import signal
    from threefold.errors import Terminated
    from tests.test_safety_checkpoint_data import _save
    real = files.write_index

    def killed(dirpath, index):
        real(dirpath, index)
        os.kill(os.getpid(), signal.SIGTERM)     # the launcher stopping the job mid-publish
    monkeypatch.setattr(files, "write_index", killed)
    with pytest.raises(Terminated):
        _save(str(tmp_path / "root"), {})
    assert os.listdir(tmp_path / "root") == []
