"""Checkpoint files, single process: round trip, atomic step directories, keep=K, frozen
parameters, and bad input (another model, truncated/corrupted/missing files, not a
checkpoint) as one-line PlanErrors that leave the model untouched."""
import json
import os

import pytest
import torch

import threefold
from threefold import PlanError
from threefold.checkpoint import files
from tests.parity import load_workload

KW = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 4}


def _build(seed=0, frozen=(), **kw):
    w = load_workload("gpt", seed=seed, **{**KW, **kw})
    for name, p in w["model"].named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    pm = threefold.parallelize(w["model"], "tp=1", w["inputs"], w["loss_fn"], target=w["target"])
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2), w


def _train(pm, opt, w, n=1):
    for _ in range(n):
        opt.zero_grad()
        pm.step(*w["inputs"], target=w["target"])
        opt.step()


def _snapshot(pm):
    return {k: v.detach().clone() for k, v in pm.engine.params.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    pm, opt, w = _build(frozen=("wpe.weight",))
    _train(pm, opt, w, 2)
    path = threefold.save(pm, opt, root, step=2, extra={"pos": 2})
    return root, path, _snapshot(pm), (pm, opt)


def test_round_trip_restores_weights_optimizer_and_frozen(saved):
    root, path, weights, opt_saved = saved
    pm, opt, w = _build(seed=7, frozen=("wpe.weight",))
    assert not pm.engine.params["wpe.weight"].requires_grad
    info = threefold.load(pm, opt, root)
    assert info["step"] == 2 and info["extra"] == {"pos": 2} and info["path"] == path
    for k, v in weights.items():
        assert torch.equal(pm.engine.params[k], v), k
    p = pm.engine.params["h.0.attn.c_attn.weight"]
    pm_saved, opt_saved = opt_saved
    p_saved = pm_saved.engine.params["h.0.attn.c_attn.weight"]
    assert torch.equal(opt.state[p]["exp_avg_sq"], opt_saved.state[p_saved]["exp_avg_sq"])
    assert float(opt.state[p]["step"]) == 2.0


def test_state_dict_gives_local_shards_with_layout(saved):
    pm, _, w = _build()
    sd = pm.state_dict()
    assert set(sd) >= set(dict(w["model"].named_parameters()))
    s = sd["h.0.attn.c_attn.weight"]
    assert s.spec is None and list(s.full_shape) == list(s.local.shape)
    # documented tensor-like (threefold.Sharded): the full shape, the shard, its placement
    assert isinstance(s, threefold.Sharded) and s.shape == w["model"].h[0].attn.c_attn.weight.shape
    assert s.ndim == 2 and s.dtype == torch.float32 and str(s.placement) == "R"
    assert "placement=R" in repr(s)
    pm.load_state_dict({k: torch.zeros_like(v.local) for k, v in sd.items()})
    assert all(float(p.detach().abs().sum()) == 0 for p in pm.engine.params.values())


def test_keep_last_k_and_atomic_replace(tmp_path):
    pm, opt, w = _build()
    root = str(tmp_path)
    for step in (1, 2, 3):
        threefold.save(pm, opt, root, step=step, keep=2)
    assert files.list_steps(root) == [files.step_name(2), files.step_name(3)]
    with open(os.path.join(root, files.LATEST)) as f:
        assert f.read().strip() == files.step_name(3)
    threefold.save(pm, opt, root, step=3, keep=2)       # same step again: replaced whole
    assert files.list_steps(root) == [files.step_name(2), files.step_name(3)]
    assert not [d for d in os.listdir(root) if d.startswith(".tmp")]


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    pm, opt, w = _build()
    root = str(tmp_path)
    threefold.save(pm, opt, root, step=1)
    before = sorted(os.listdir(os.path.join(root, files.step_name(1))))

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(files, "publish", crash)
    with pytest.raises(OSError):
        threefold.save(pm, opt, root, step=2)
    assert files.list_steps(root) == [files.step_name(1)]
    assert sorted(os.listdir(os.path.join(root, files.step_name(1)))) == before
    assert not [d for d in os.listdir(root) if d.startswith(".tmp")]
    pm2, opt2, _ = _build(seed=3)
    assert threefold.load(pm2, opt2, root)["step"] == 1


def _copy(path, tmp_path):
    import shutil
    dst = str(tmp_path / "copy")
    shutil.copytree(path, dst)
    return dst


def _shard(ckpt):
    return os.path.join(ckpt, sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0])


def _expect_error(pm, opt, path, *words):
    before = _snapshot(pm)
    with pytest.raises(PlanError) as e:
        threefold.load(pm, opt, path)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert all(torch.equal(pm.engine.params[k], v) for k, v in before.items()), "weights changed"
    assert not opt.state, "optimizer state changed"
    return msg


def test_checkpoint_of_another_model_lists_names_and_shapes(saved, tmp_path):
    root, *_ = saved
    pm, opt, _ = _build(n_layer=3)
    msg = _expect_error(pm, opt, root, "another model", "missing from the checkpoint", "h.2.")
    pm, opt, _ = _build(n_embd=16, n_head=2)
    _expect_error(pm, opt, root, "another model", "shapes differ", "saved [")


def test_truncated_corrupted_and_missing_files(saved, tmp_path):
    _, path, *_ = saved
    pm, opt, _ = _build(seed=5)
    bad = _copy(path, tmp_path / "t")
    with open(_shard(bad), "r+b") as f:
        f.truncate(os.path.getsize(_shard(bad)) // 2)
    _expect_error(pm, opt, bad, "truncated")
    bad = _copy(path, tmp_path / "c")
    with open(_shard(bad), "r+b") as f:
        f.seek(os.path.getsize(_shard(bad)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    _expect_error(pm, opt, bad, "checksum", "corrupted")
    bad = _copy(path, tmp_path / "m")
    os.remove(_shard(bad))
    _expect_error(pm, opt, bad, "missing")
    bad = _copy(path, tmp_path / "i")
    with open(os.path.join(bad, files.INDEX), "w") as f:
        f.write("{not json")
    _expect_error(pm, opt, bad, files.INDEX, "unreadable")


def test_not_a_checkpoint(tmp_path):
    pm, opt, _ = _build()
    _expect_error(pm, opt, str(tmp_path), "not a threefold checkpoint")
    _expect_error(pm, opt, str(tmp_path / "nowhere"), "does not exist")
    (tmp_path / "x.txt").write_text("hi")
    _expect_error(pm, opt, str(tmp_path / "x.txt"), "is a file")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / files.INDEX).write_text(json.dumps({"format": "other"}))
    _expect_error(pm, opt, str(tmp_path / "d"), "not a threefold checkpoint index")


def test_a_tensor_parallel_shard_says_its_full_shape_and_placement():
    from threefold.checkpoint.layout import Sharded, local_shape, pieces
    from threefold.runtime.shard import ShardSpec
    spec = ShardSpec(dim=0, blocks=(8, 8, 8), padded=24, t=2)      # a fused q/k/v weight, tp=2
    full = torch.arange(24 * 3.0).reshape(24, 3)
    local = spec(full, 1)
    dim, parts = pieces(spec, [24, 3], 1)
    s = Sharded(local, dim, parts, [24, 3])
    s.spec = spec
    assert s.shape == (24, 3) and s.size(0) == 24 and list(s.local.shape) == local_shape(spec, [24, 3], 1) == [12, 3]
    assert str(s.placement) == "S(0,blocks=[8, 8, 8])"
    for p in s.parts:      # every piece is the full tensor's rows it says
        assert torch.equal(s.view(p), full[p.start:p.start + p.length])
