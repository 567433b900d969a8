"""`train --weights DIR/model.safetensors` loads threefold's own export of the embedded GPT
(issue 45 item 5): under dp=2 (the batch dimension is the embedded data's, said rather than
inferred on a meta-device model) the first loss equals one process's with the same weights,
and differs from a fresh model's."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import threefold
from tests.parity import ROOT

COMMON = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq", "8", "--batch", "4", "--steps", "1",
          "--eval-every", "0", "--sample-tokens", "0", "--warmup", "0", "--json"]


def _first_loss(tmp_path, name, *flags):
    out = subprocess.run([sys.executable, "-m", "threefold", "train", *COMMON, *flags, "--out", str(tmp_path / name)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                         timeout=500)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["first_loss"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_weights_loads_threefolds_own_export_of_the_embedded_gpt(tmp_path):
    from threefold.cli.main import main
    from threefold.models.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)       # far from any fresh initialisation
    x = torch.randint(0, 256, (4, 8))
    pm = threefold.parallelize(model, "tp=1", (x,), lm_loss, target=x.roll(-1, 1))
    threefold.save(pm, None, str(tmp_path / "ck"), extra={"generate": {"gpt": dataclasses.asdict(cfg),
                                                                       "tokenizer": {"kind": "byte"}}})
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    weights = str(tmp_path / "exp" / "model.safetensors")
    dp2 = _first_loss(tmp_path, "a", "--plan", "dp=2", "--weights", weights)
    one = _first_loss(tmp_path, "b", "--plan", "tp=1", "--weights", weights)
    fresh = _first_loss(tmp_path, "c", "--plan", "tp=1")
    assert dp2 == pytest.approx(one, rel=1e-5) and abs(one - fresh) > 1e-3, (dp2, one, fresh)
