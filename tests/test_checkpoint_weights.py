"""parallelize(meta model, weights=PATH): shards read from safetensors slices; parameters the
file lacks get their module's init, seeded by FQN (the same on every rank and every run)."""
import json
import os

import pytest
import torch

import threefold
from threefold.checkpoint.weights import WeightSource, empty_weights
from threefold.models.gpt import GPT, GPTConfig, lm_loss
from threefold.runtime.launch import launch
from tests.parity import max_rel_diff

# vocab 97: tp=2 pads it to 98; c_attn is a fused QKV (block-strided shards)
CFG = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)
MISSING = "h.1.mlp.c_fc.weight"


def _real():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _batch():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG["vocab_size"], (4, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _write(model, path, sharded: bool):
    from safetensors.torch import save_file
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
          if k not in (MISSING, "lm_head.weight")}      # lm_head is tied to wte, as HF saves it
    if not sharded:
        save_file(sd, path)
        return path
    os.makedirs(path)
    keys = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in halves.items():
        save_file({k: sd[k] for k in ks}, os.path.join(path, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: n for n, ks in halves.items() for k in ks}}, f)
    return path


def _meta():
    with empty_weights():
        return GPT(GPTConfig(**CFG))



def _missing_init():
    from threefold.checkpoint.init_shard import ShardInit
    meta = _meta()
    return ShardInit(meta, "(test)").init_full(MISSING, dict(meta.named_parameters())[MISSING].shape)


def test_meta_model_loads_file_and_inits_the_rest(tmp_path):
    real = _real()
    path = _write(real, str(tmp_path / "w.safetensors"), sharded=False)
    inputs, target = _batch()
    model = _meta()
    assert all(p.is_meta for p in model.parameters())
    pm = threefold.parallelize(model, "tp=1", (inputs,), lm_loss, target=target, weights=path)
    for name, p in real.named_parameters():
        got = pm.engine.params[name]
        if name == MISSING:
            assert not torch.equal(got, p) and torch.equal(got, _missing_init())   # reproducible
        else:
            assert torch.equal(got, p.detach()), name


def test_bad_weights_are_plan_errors(tmp_path):
    inputs, target = _batch()
    with pytest.raises(threefold.PlanError, match="does not exist"):
        threefold.parallelize(_meta(), "tp=1", (inputs,), lm_loss, target=target, weights=str(tmp_path / "x"))
    other = GPT(GPTConfig(**{**CFG, "n_embd": 16}))
    path = _write(other, str(tmp_path / "o.safetensors"), sharded=False)
    with pytest.raises(threefold.PlanError, match="another model"):
        threefold.parallelize(_meta(), "tp=1", (inputs,), lm_loss, target=target, weights=path)


def _tp2_rank(path):
    torch.set_num_threads(1)
    inputs, target = _batch()
    pm = threefold.parallelize(_meta(), "tp=2", (inputs,), lm_loss, target=target, weights=path)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(pm.step(inputs, target=target))
        opt.step()
    return losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_from_a_sharded_hf_directory_matches_single_process(tmp_path):
    real = _real()
    path = _write(real, str(tmp_path / "hf"), sharded=True)
    with torch.no_grad():
        dict(real.named_parameters())[MISSING].copy_(_missing_init())
    inputs, target = _batch()
    opt = torch.optim.SGD(real.parameters(), lr=0.1)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = lm_loss(real(inputs), target)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    for losses in launch(_tp2_rank, 2, path, timeout=280):
        assert max_rel_diff(losses, expected) < 1e-5, (losses, expected)
