"""threefold export: a checkpoint becomes a directory transformers' from_pretrained loads,
with the same logits as the trained model; bad input is exit 2 with one line."""
import pytest
import torch

import threefold
from threefold.cli.main import main
from tests.parity import load_workload

KW = {"gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq": 8, "batch": 4},
      "llama": {"n_layer": 2, "hidden": 32, "n_head": 4, "n_kv_head": 2, "intermediate": 64,
                "vocab_size": 64, "seq": 8, "batch": 4}}


@pytest.mark.parametrize("arch,shard", [("gpt2", None), ("llama", None), ("llama", "20KB")])
def test_export_loads_in_transformers_with_equal_logits(arch, shard, tmp_path):
    from transformers import AutoModelForCausalLM
    w = load_workload(arch, **KW[arch])
    pm = threefold.parallelize(w["model"], "tp=1", w["inputs"], w["loss_fn"], target=w["target"])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt.zero_grad()
    pm.step(*w["inputs"], target=w["target"])
    opt.step()
    threefold.save(pm, opt, str(tmp_path / "ckpt"))
    cfg_dir = tmp_path / "cfg"
    w["model"].model.config.save_pretrained(cfg_dir)
    size = ["--max-shard-size", shard] if shard else []
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--hf-config", str(cfg_dir)]
                + size) == 0
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    if shard:     # Hugging Face's sharded layout: numbered files, each within the limit, and an index
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        assert all((tmp_path / "hf" / f).stat().st_size < 20_000 + 4096 for f in files)
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    else:
        assert files == ["model.safetensors"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = load_workload(arch, seed=9, **KW[arch])["model"].eval()   # other weights, then pm's
    with torch.no_grad():
        for name, p in trained.named_parameters():
            p.copy_(pm.engine.params[name])
        expected = trained(*w["inputs"])
        got = hf(w["inputs"][0]).logits
    assert not torch.allclose(expected, load_workload(arch, **KW[arch])["model"].eval()(*w["inputs"]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_export_bad_input_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a threefold checkpoint" in err and "\n" not in err


def test_max_shard_size_is_checked_first(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-size", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-shard-size 'lots' is not a size" in err and "\n" not in err


def _embedded_gpt_checkpoint(tmp_path):
    """A checkpoint as `threefold train` saves one for its embedded GPT (the run records the
    GPT's config in extra["generate"]), after a step of AdamW."""
    import dataclasses
    from threefold.models.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg)
    x = torch.randint(0, 64, (4, 8))
    pm = threefold.parallelize(model, "tp=1", (x,), lm_loss, target=x.roll(-1, 1))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.step(x, target=x.roll(-1, 1))
    opt.step()
    threefold.save(pm, opt, str(tmp_path / "ckpt"), extra={"generate": {"gpt": dataclasses.asdict(cfg)}})
    trained = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in trained.named_parameters():
            p.copy_(pm.engine.params[name])
    return cfg, trained, x


def test_the_embedded_gpt_exports_as_gpt2_with_equal_logits(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel
    from threefold.models.gpt_hf import gpt2_config
    cfg, trained, x = _embedded_gpt_checkpoint(tmp_path)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()          # was missing: from_pretrained failed
    with torch.no_grad():
        expected = trained(x)
        got = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # --hf-config with a GPT-2 config of the same model is accepted (was: no tensor for transformer.wte...)
    gpt2_config(cfg).save_pretrained(tmp_path / "cfg")
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2"),
                 "--hf-config", str(tmp_path / "cfg")]) == 0
    with torch.no_grad():
        got = GPT2LMHeadModel.from_pretrained(tmp_path / "hf2").eval()(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # one that would compute another function (GPT-2's default tanh GELU) is one line, exit 2
    GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2).save_pretrained(tmp_path / "tanh")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf3"),
                 "--hf-config", str(tmp_path / "tanh")]) == 2
    err = capsys.readouterr().err.strip()
    assert "activation_function='gelu_new'" in err and "\n" not in err
