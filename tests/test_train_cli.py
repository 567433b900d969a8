"""threefold train end to end: a SPEC's own data source, --batch/--seq rules, the metrics it
writes, the final sample, and `threefold generate` on the checkpoint it saved."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.parity import ROOT


def _threefold(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "threefold", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_batch_or_seq_for_a_fixed_batch_spec_is_one_line(tmp_path, capsys, monkeypatch):
    from threefold.cli.main import main
    monkeypatch.chdir(ROOT)
    assert main(["train", "tests/train_specs.py:fixed", "--seq", "8", "--steps", "1", "--json",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--seq 8 means nothing for SPEC" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spec_batches_train_under_dp_with_metrics_sample_and_generate(tmp_path):
    from tests.train_specs import batch_at, model
    from threefold.models.gpt import lm_loss
    from threefold.train.lr_schedule import WarmupCosine
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out = _threefold("train", "tests/train_specs.py:stepped", "--plan", "dp=2", "--batch", "4", "--seq", "8",
                     "--steps", "4", "--warmup", "1", "--lr", "0.01", "--min-lr", "0.001", "--eval-every", "2",
                     "--eval-batches", "2", "--sample-tokens", "10", "--sample-prompt", "the ",
                     "--save-every", "4", "--ckpt-dir", str(ckpt), "--json", "--out", str(run))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    # the first step trains on batches(0) at --batch 4 --seq 8: its loss is one process's
    x, y = batch_at(0, 4, 8)
    assert summary["first_loss"] == pytest.approx(lm_loss(model(8)(x), y).item(), rel=1e-5)
    losses = json.load(open(run / "losses.json"))["losses"]
    assert len(losses) == 4 and len(set(losses)) == 4
    assert [s for s, _ in summary["val_losses"]] == [0, 2, 4]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    schedule = WarmupCosine(0.01, 0.001, 1, 4)
    assert [r["lr"] for r in rows] == pytest.approx([schedule(i) for i in range(4)])
    assert all(r["grad_norm"] > 0 and r["model_flops_per_s"] > 0 and len(r["memory"]) == 2 for r in rows)
    assert [r["val_loss"] is not None for r in rows] == [False, True, False, True]
    assert summary["tokens_per_second"] == pytest.approx(rows[-1]["tokens_per_s_avg"])   # the bar's figure
    for name in ("loss.png", "lr.png", "tokens_per_second.png"):
        assert os.path.getsize(run / name) > 1000
    assert summary["sample"].startswith("the ") and len(summary["sample"]) == 14
    gen = _threefold("generate", str(ckpt), "--prompt", "the ", "--tokens", "10", "--json", "--trust-recorded-spec",
                     timeout=120)
    assert gen.returncode == 0, gen.stderr[-2000:]
    # the recorded SPEC (confirmed: a file outside the checkpoint) and tokenizer rebuild the model
    assert "the " + json.loads(gen.stdout)["text"] == summary["sample"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_from_an_embedded_run_checkpoint_matches_the_runs_sample(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    common = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq", "16", "--batch", "4"]
    out = _threefold("train", "--plan", "pp=2,m=2", "--steps", "3", "--save-every", "3", "--ckpt-dir", str(ckpt),
                     "--eval-every", "0", "--sample-tokens", "12", "--sample-prompt", "def ", "--json",
                     "--out", str(run), *common)
    assert out.returncode == 0, out.stderr[-3000:]
    sample = json.loads(out.stdout.strip().splitlines()[-1])["sample"]
    assert open(run / "sample.txt").read() == sample
    gen = _threefold("generate", str(ckpt), "--prompt", "def ", "--tokens", "12", timeout=120)
    assert gen.returncode == 0, gen.stderr[-2000:]
    from threefold.cli.train_cmd import printable
    assert gen.stdout.rstrip("\n") == printable(sample).rstrip("\n")   # 2 stages' pieces made whole, twice
    assert all(c.isprintable() or c in "\n\t" for c in gen.stdout)     # no control bytes to the terminal
    greedy = [_threefold("generate", str(ckpt), "--prompt", "def ", "--tokens", "8", "--temperature", "0",
                         "--json", timeout=120) for _ in range(2)]
    texts = [json.loads(g.stdout)["text"] for g in greedy]
    assert texts[0] == texts[1] and json.loads(greedy[0].stdout)["tokens"] == 8
    bad = _threefold("generate", str(tmp_path), "--prompt", "x", timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    # export: a GPT-2 directory (config.json written) that from_pretrained loads, same logits
    from transformers import GPT2LMHeadModel
    from threefold.checkpoint.export import consolidate
    from threefold.cli.generate_cmd import build_model, read_generate_info
    from threefold.cli.main import main
    from threefold.train.generate import load_into
    assert main(["export", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    path, full = consolidate(str(ckpt))
    model = build_model(read_generate_info(path), None)[0]
    load_into(model, full)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        got = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(x).logits
        torch.testing.assert_close(got, model.eval()(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags,word", [(["--tokens", "-1"], "--tokens -1"), (["--temperature", "-1"], "--temperature"),
                                        (["--temperature", "nan"], "--temperature"), (["--top-k", "0"], "--top-k 0")])
def test_generate_bad_numbers_are_one_line(tmp_path, capsys, flags, word):
    from threefold.cli.main import main
    assert main(["generate", str(tmp_path), "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert word in err and len(err.strip().splitlines()) == 1, err
