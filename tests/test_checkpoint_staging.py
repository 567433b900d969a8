"""Asynchronous saves staged in /dev/shm (checkpoint/staging.py), single process: a snapshot
sealed before a failure is committed as the newest checkpoint, equal to a blocking save of
that step; an unsealed or corrupted one is not (the previous checkpoint stays newest); no
staged file outlives a save, a failure or a settle."""
import os

import pytest
import torch

import threefold
from threefold.checkpoint import files, reader, staging
from threefold.checkpoint.async_save import AsyncSaver
from threefold.checkpoint.save import _collect, index_fields
from tests.test_checkpoint_async import _build
from tests.test_checkpoint_files import _snapshot, _train

pytestmark = pytest.mark.skipif(staging.stage_dir("x") is None, reason="no writable /dev/shm")


def _staged(pm, opt, root, step, seal=True):
    snap = staging.Snapshot(staging.stage_dir(root), step, 0, 1)
    snap.stage(_collect(pm, opt, step, {"pos": step}, 0), index_fields(pm, opt, step), 2)
    if seal:
        snap.seal()
    return snap


def _loaded(root):
    fresh, opt, _ = _build(seed=9)
    info = threefold.load(fresh, opt, root)
    return info, _snapshot(fresh), {k: opt.state[p]["exp_avg"] for k, p in fresh.engine.params.items()}


def test_a_sealed_snapshot_is_committed_as_the_newest_checkpoint_equal_to_a_blocking_save(tmp_path):
    pm, opt, w = _build()
    root = str(tmp_path / "ckpt")
    threefold.save(pm, opt, root, step=1)
    _train(pm, opt, w, 2)
    _staged(pm, opt, root, 3)           # the background write never happened: the rank was killed
    threefold.save(pm, opt, str(tmp_path / "blocking"), step=3, extra={"pos": 3})
    path = staging.settle(root)
    assert path == os.path.join(root, files.step_name(3)) and reader.resolve(root) == path
    assert not os.path.exists(staging.stage_dir(root))
    info, params, moments = _loaded(root)
    want_info, want_params, want_moments = _loaded(str(tmp_path / "blocking"))
    assert info["step"] == 3 and info["extra"] == {"pos": 3}
    for k in want_params:
        assert torch.equal(params[k], want_params[k]) and torch.equal(moments[k], want_moments[k]), k


@pytest.mark.parametrize("damage", ["unsealed", "corrupted", "older"])
def test_a_snapshot_that_is_not_whole_and_newer_is_dropped_and_the_previous_stays(tmp_path, damage):
    pm, opt, w = _build()
    root = str(tmp_path / "ckpt")
    _train(pm, opt, w, 1)
    threefold.save(pm, opt, root, step=4)
    snap = _staged(pm, opt, root, 2 if damage == "older" else 5, seal=damage != "unsealed")
    if damage == "corrupted":
        with open(snap.data_path, "r+b") as f:
            f.seek(7)
            byte = f.read(1)
            f.seek(7)
            f.write(bytes([byte[0] ^ 0xFF]))
    assert staging.settle(root, quiet=True) is None
    assert files.list_steps(root) == [files.step_name(4)] and reader.resolve(root).endswith(files.step_name(4))
    assert not os.path.exists(staging.stage_dir(root))


def test_async_saves_leave_nothing_staged(tmp_path, monkeypatch):
    pm, opt, w = _build()
    root = str(tmp_path)
    saver = AsyncSaver()
    for step in (1, 2):
        _train(pm, opt, w, 1)
        saver.save(pm, opt, root, step=step)
    saver.wait()
    assert not os.path.exists(staging.stage_dir(root))

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(files, "publish", crash)
    saver.save(pm, opt, root, step=3)
    with pytest.raises(OSError):
        saver.wait()
    assert not os.path.exists(staging.stage_dir(root))     # alone: nobody else can settle it


def test_a_full_dev_shm_stages_in_memory_and_still_saves(tmp_path, monkeypatch, capsys):
    import errno
    pm, opt, w = _build()
    _train(pm, opt, w, 1)

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    saver = AsyncSaver()
    saver.save(pm, opt, str(tmp_path), step=1)
    assert saver.wait() == os.path.join(str(tmp_path), files.step_name(1))
    assert "staging them in memory" in capsys.readouterr().err and saver.shm is False
    assert not os.path.exists(staging.stage_dir(str(tmp_path)))
    _, params, _ = _loaded(str(tmp_path))
    assert all(torch.equal(params[k], v) for k, v in _snapshot(pm).items())
