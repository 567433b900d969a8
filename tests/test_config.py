"""threefold.config: embedded defaults < --config FILE < flags, --print-config, and one-line
errors for bad keys, types and values; `threefold train` bad data fails before any rank."""
import os
import tomllib

import pytest

from threefold.cli.main import main
from threefold.config import FIELDS, HEADER, TrainConfig, default_toml, load_config, to_toml
from threefold.errors import PlanError


def _file(tmp_path, text, name="c.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_embedded_toml_is_the_dataclass_defaults():
    assert default_toml().decode() == HEADER + to_toml(TrainConfig())   # regenerate: python -m threefold.config
    cfg = load_config()
    assert cfg == TrainConfig() and cfg.given == frozenset()
    assert all(f.metadata["section"] in tomllib.loads(default_toml().decode()) for f in FIELDS.values())


def test_file_overrides_defaults_and_flags_override_the_file(tmp_path):
    path = _file(tmp_path, 'steps = 7\n[optim]\nlr = 0.01\nbetas = [0.8, 0.9]\n[data]\nseq = 32\n')
    cfg = load_config(path)
    assert (cfg.steps, cfg.lr, cfg.betas, cfg.seq, cfg.batch) == (7, 0.01, (0.8, 0.9), 32, TrainConfig().batch)
    cfg = load_config(path, {"lr": 0.02, "seq": None, "betas": "0.7,0.75"})   # None: flag not given
    assert (cfg.steps, cfg.lr, cfg.betas, cfg.seq) == (7, 0.02, (0.7, 0.75), 32)
    assert cfg.given == {"steps", "lr", "betas", "seq"}


def test_printed_config_reads_back_to_the_same_values(tmp_path):
    cfg = load_config(None, {"data": "some/dir", "resume": "", "sample_prompt": 'say "hi"\n', "json": True,
                             "dropout": 0.1, "plan": "tp=2,dp=2"})
    again = load_config(_file(tmp_path, cfg.to_toml()))
    assert again == cfg and again.resume == "" and again.ckpt_dir is None


BAD_FILES = {
    "unknown key": ("[optim]\nlrr = 1\n", "unknown key 'lrr' in \\[optim\\] \\(did you mean 'lr'\\?\\)"),
    "unknown top-level key": ("stepz = 1\n", "unknown key 'stepz'"),
    "unknown section": ("[optimizer]\nlr = 1\n", "unknown section \\[optimizer\\]"),
    "wrong section": ("[data]\nlr = 0.1\n", "'lr' belongs in \\[optim\\]"),
    "string for a number": ('[optim]\nlr = "fast"\n', '\\[optim\\] lr = "fast" is invalid: lr takes a number'),
    "float for an integer": ("steps = 2.5\n", "steps takes an integer"),
    "bool for an integer": ("steps = true\n", "steps takes an integer"),
    "one beta": ("[optim]\nbetas = [0.9]\n", "betas takes two numbers"),
    "out of range": ("[optim]\nmin_lr = 1.0\n", "min_lr = 1.0 is invalid: use 0..lr"),
    "not toml": ("steps = = 3\n", "is not valid TOML"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_config_files_are_one_line_errors(tmp_path, case):
    text, match = BAD_FILES[case]
    with pytest.raises(PlanError, match=match) as e:
        load_config(_file(tmp_path, text))
    assert "\n" not in str(e.value) and "c.toml" in str(e.value)


def test_bad_flags_name_the_flag():
    with pytest.raises(PlanError, match="^--n-embd 65 is invalid: use a positive multiple of n_head"):
        load_config(None, {"n_embd": 65})
    with pytest.raises(PlanError, match='^--betas "0.9" is invalid: betas takes two numbers'):
        load_config(None, {"betas": "0.9"})
    with pytest.raises(PlanError, match="does not exist"):
        load_config("/nonexistent/threefold.toml")


def test_embedded_only_settings_are_refused_for_a_spec(tmp_path):
    with pytest.raises(PlanError, match="^--n-layer 2 means nothing for SPEC 'm.py:f'"):
        load_config(None, {"spec": "m.py:f", "n_layer": 2})
    with pytest.raises(PlanError, match="c.toml: \\[data\\] data = \"x.txt\" means nothing"):
        load_config(_file(tmp_path, '[data]\ndata = "x.txt"\n'), {"spec": "m.py:f"})
    assert load_config(None, {"spec": "m.py:f", "lr": 0.01}).lr == 0.01


def test_print_config_shows_the_resolved_values_and_exits_0(tmp_path, capsys):
    path = _file(tmp_path, "[run]\nsteps = 9\n[optim]\nlr = 0.01\n")
    assert main(["train", "--config", path, "--lr", "0.02", "--no-json", "--print-config"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["run"]["steps"] == 9 and shown["optim"]["lr"] == 0.02 and shown["run"]["json"] is False
    assert shown["data"]["seq"] == TrainConfig().seq


@pytest.fixture
def no_ranks(monkeypatch):
    import threefold.runtime.launch as launch_mod

    def tripwire(*a, **k):
        raise AssertionError("ranks were spawned for bad input")
    monkeypatch.setattr(launch_mod, "launch", tripwire)


@pytest.mark.parametrize("flags, match", [
    (["--data", "{tmp}/missing.txt"], "does not exist"),
    (["--data", "{tmp}/short.txt"], "fewer than seq\\+1"),
    (["--tokenizer", "{tmp}"], "has no tokenizer.json"),
    (["--data", "{tmp}/ids.bin"], "token id 999"),
    (["--config", "{tmp}/bad.toml"], "unknown key 'lrr'"),
    (["--steps", "0"], "--steps 0 is invalid"),
])
def test_bad_train_input_exits_2_before_any_rank(tmp_path, capsys, no_ranks, flags, match):
    import re

    import numpy as np
    (tmp_path / "short.txt").write_text("too short")
    (tmp_path / "bad.toml").write_text("[optim]\nlrr = 1\n")
    np.full(200, 999, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    argv = ["train", "--out", str(tmp_path / "out")] + [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err
    assert not os.path.exists(tmp_path / "out")
