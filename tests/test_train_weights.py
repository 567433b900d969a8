"""threefold train SPEC --weights PATH: the SPEC's model is built on meta and every rank reads
its slices from the file; a missing or foreign file is one line before any rank starts."""
import json
import subprocess
import sys

import pytest
import torch

from tests.parity import ROOT


def _save(model, path):
    from safetensors.torch import save_file
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(path))       # tied to wte, as Hugging Face saves it
    return str(path)


def _other_weights():
    from tests.train_specs import VOCAB
    from threefold.models.gpt import GPT, GPTConfig
    torch.manual_seed(5)                                   # not the SPEC's own seed
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=16))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spec_trains_from_the_weights_file_under_tp2(tmp_path):
    from tests.train_specs import batch_at, model
    from threefold.models.gpt import lm_loss
    source = _other_weights()
    path = _save(source, tmp_path / "w.safetensors")
    out = subprocess.run([sys.executable, "-m", "threefold", "train", "tests/train_specs.py:stepped", "--weights",
                          path, "--plan", "tp=2", "--steps", "2", "--batch", "4", "--seq", "8", "--eval-every", "0",
                          "--sample-tokens", "0", "--json", "--out", str(tmp_path / "run")],
                         cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    first = json.loads(out.stdout.strip().splitlines()[-1])["first_loss"]
    x, y = batch_at(0, 4, 8)
    with torch.no_grad():
        assert first == pytest.approx(lm_loss(source(x), y).item(), rel=1e-5)       # the file's weights
        assert first != pytest.approx(lm_loss(model(8)(x), y).item(), rel=1e-3)     # not the SPEC's


@pytest.mark.parametrize("case", ["missing", "foreign"])
def test_bad_weights_fail_in_the_parent_in_one_line(tmp_path, capsys, monkeypatch, case):
    from threefold.cli.main import main
    from threefold.models.gpt import GPT, GPTConfig
    monkeypatch.chdir(ROOT)
    if case == "missing":
        path, words = str(tmp_path / "nothing.safetensors"), "does not exist"
    else:
        path, words = _save(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)),
                            tmp_path / "small.safetensors"), "of another model"
    assert main(["train", "tests/train_specs.py:stepped", "--weights", path, "--plan", "tp=2", "--steps", "1",
                 "--json", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err
