"""threefold export --adapters: a LoRA fine-tune of a PEFT model becomes PEFT's adapter
directory (adapter_config.json + adapter_model.safetensors), which
peft.PeftModel.from_pretrained(base, DIR) loads to the trained model's logits."""
import json

import pytest
import torch

import threefold
from threefold.cli.main import main
from tests.parity import load_workload

peft = pytest.importorskip("peft")   # in the hf and test extras

KW = {"n_layer": 2, "hidden": 32, "n_head": 4, "n_kv_head": 2, "intermediate": 64, "vocab_size": 64,
      "seq": 8, "batch": 4}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


class Holder(torch.nn.Module):
    """A training wrapper around the PeftModel (its names get a prefix of their own)."""

    def __init__(self, peft_model):
        super().__init__()
        self.peft = peft_model

    def forward(self, input_ids):
        return self.peft(input_ids=input_ids, use_cache=False).logits


def _base(seed=0):
    torch.manual_seed(seed)
    return load_workload("llama", **KW)["model"].model      # the transformers model


def _lora(base):
    return peft.get_peft_model(base, peft.LoraConfig(**LORA))


def _trained_checkpoint(tmp_path, extra_trainable=False):
    w = load_workload("llama", **KW)
    model = Holder(_lora(_base()))
    if extra_trainable:     # a tensor outside the adapter trained too
        model.peft.base_model.model.model.norm.weight.requires_grad_(True)
    pm = threefold.parallelize(model, "tp=1", w["inputs"], w["loss_fn"], target=w["target"])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        pm.step(*w["inputs"], target=w["target"])
        opt.step()
    threefold.save(pm, opt, str(tmp_path / "ckpt"))
    cfg = tmp_path / "lora"
    model.peft.peft_config["default"].save_pretrained(str(cfg))
    return pm, w, cfg


def test_adapter_export_loads_in_peft_with_equal_logits(tmp_path):
    pm, w, cfg = _trained_checkpoint(tmp_path)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "adapter"), "--adapters",
                 "--peft-config", str(cfg)]) == 0
    out = tmp_path / "adapter"
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not list(out.glob("model*.safetensors"))       # the adapter only, not the base
    from safetensors.torch import load_file
    keys = sorted(load_file(out / "adapter_model.safetensors"))
    # PEFT's own names: relative to the PeftModel, adapter name removed, every adapted projection
    assert keys == sorted(f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
                          for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB")
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 8

    loaded = peft.PeftModel.from_pretrained(_base(), str(out)).eval()
    expected = Holder(_lora(_base(seed=7))).eval()     # other weights, then pm's trained ones
    with torch.no_grad():
        for name, p in expected.named_parameters():
            p.copy_(pm.engine.params[name])
        want = expected(w["inputs"][0])
        got = loaded(input_ids=w["inputs"][0], use_cache=False).logits
        untrained = _lora(_base()).eval()(input_ids=w["inputs"][0], use_cache=False).logits
    assert not torch.allclose(got, untrained, atol=1e-4)      # the adapters were trained and loaded
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_adapter_export_refuses_losing_a_trained_tensor(tmp_path, capsys):
    _, _, cfg = _trained_checkpoint(tmp_path, extra_trainable=True)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a"), "--adapters",
                 "--peft-config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert "norm.weight is not part of adapter 'default'" in err and "\n" not in err
    assert not (tmp_path / "a").exists()


def test_adapter_export_needs_the_lora_config(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "a"), "--adapters"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--adapters needs --peft-config" in err and "\n" not in err
    (tmp_path / "c.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "a"), "--adapters",
                 "--peft-config", str(tmp_path / "c.json")]) == 2
    assert "not a LoRA config" in capsys.readouterr().err
