"""Asynchronous checkpoints (checkpoint/async_save.py), single process: what the background
write publishes is the state at the save, not what training changed while it was written;
the guarantees of a blocking save hold (published only whole, a failed write leaves the
previous checkpoints and no temporary directory, its error raised on the step loop)."""
import os

import pytest
import torch

import threefold
from threefold.checkpoint import files, reader
from threefold.checkpoint.async_save import AsyncSaver, stage
from threefold.checkpoint.save import _collect
from tests.parity import load_workload
from tests.test_checkpoint_files import _snapshot, _train

KW = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 4}


def _build(seed=0, plan="tp=1"):
    w = load_workload("gpt", seed=seed, **KW)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2), w


def test_the_background_write_keeps_the_state_at_the_save_while_training_goes_on(tmp_path):
    pm, opt, w = _build()
    _train(pm, opt, w, 2)
    at_save = _snapshot(pm)
    moments = {k: opt.state[p]["exp_avg"].clone() for k, p in pm.engine.params.items()}
    saver = AsyncSaver()
    saver.save(pm, opt, str(tmp_path), step=2, extra={"pos": 2}, keep=2)
    _train(pm, opt, w, 3)                 # changes every parameter in place while it writes
    assert any(not torch.equal(pm.engine.params[k], v) for k, v in at_save.items())
    path = saver.wait()
    assert path == os.path.join(str(tmp_path), files.step_name(2))
    fresh, opt2, _ = _build(seed=5)
    info = threefold.load(fresh, opt2, str(tmp_path))
    assert info["step"] == 2 and info["extra"] == {"pos": 2}
    for k, v in at_save.items():
        assert torch.equal(fresh.engine.params[k], v), k
        assert torch.equal(opt2.state[fresh.engine.params[k]]["exp_avg"], moments[k]), k


def test_async_and_blocking_saves_load_the_same_state(tmp_path):
    pm, opt, w = _build()
    _train(pm, opt, w, 2)
    saver = AsyncSaver()
    saver.save(pm, opt, str(tmp_path / "a"), step=2)
    saver.wait()
    threefold.save(pm, opt, str(tmp_path / "b"), step=2)
    a = reader.read_index(reader.resolve(str(tmp_path / "a")))
    b = reader.read_index(reader.resolve(str(tmp_path / "b")))
    assert {k: v[0] for k, v in a["files"].items()} == {k: v[0] for k, v in b["files"].items()}
    loaded = []
    for d in ("a", "b"):
        fresh, o, _ = _build(seed=9)
        threefold.load(fresh, o, str(tmp_path / d))
        loaded.append(_snapshot(fresh))
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])


def test_staged_pieces_are_copies():
    pm, opt, w = _build()
    _train(pm, opt, w, 1)
    sd = _collect(pm, opt, 1, None, 0)
    staged = stage(sd)
    live = {t.untyped_storage().data_ptr() for t in pm.engine.params.values()}
    for key, value in staged.items():
        if hasattr(value, "_pieces"):
            for piece in value._pieces.values():
                assert piece.untyped_storage().data_ptr() not in live, key


def test_a_failed_background_write_raises_on_the_loop_and_keeps_the_previous(tmp_path, monkeypatch):
    pm, opt, w = _build()
    root = str(tmp_path)
    saver = AsyncSaver()
    saver.save(pm, opt, root, step=1)
    saver.wait()
    before = sorted(os.listdir(os.path.join(root, files.step_name(1))))

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(files, "publish", crash)
    _train(pm, opt, w, 1)
    saver.save(pm, opt, root, step=2)
    with pytest.raises(OSError):
        saver.wait()
    assert files.list_steps(root) == [files.step_name(1)]
    assert sorted(os.listdir(os.path.join(root, files.step_name(1)))) == before
    assert not [d for d in os.listdir(root) if d.startswith(".tmp")]
    assert saver.wait() == os.path.join(root, files.step_name(1))   # the error is raised once


def test_a_save_waits_for_the_one_in_flight(tmp_path):
    pm, opt, w = _build()
    saver = AsyncSaver()
    for step in (1, 2, 3):
        _train(pm, opt, w, 1)
        saver.save(pm, opt, str(tmp_path), step=step, keep=2)
    saver.wait()
    assert files.list_steps(str(tmp_path)) == [files.step_name(2), files.step_name(3)]
    assert len(saver.stage_seconds) == 3
