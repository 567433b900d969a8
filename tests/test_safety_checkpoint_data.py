"""Files are data, round 2 (issue 45): a checkpoint never chooses code, and every malformed
metadata field is one line (exit 2) naming the file and the field, in bounded time, from
generate, export, `train --resume` (before any rank starts) and threefold.load.

Each case edits a real checkpoint as an attacker or a broken disk would, then rewrites the
CRCs in threefold.json (whoever edits a file edits its checksum too)."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import sys
import time
import zlib

import pytest
import torch

import threefold
from threefold import PlanError
from threefold.cli.main import main


def _reindex(ckpt: str, *names: str) -> None:
    path = os.path.join(ckpt, "threefold.json")
    with open(path) as f:
        index = json.load(f)
    for name in names:
        with open(os.path.join(ckpt, name), "rb") as f:
            data = f.read()
        index["files"][name] = [len(data), zlib.crc32(data)]
    with open(path, "w") as f:
        json.dump(index, f)


def _edit_index(ckpt: str, edit) -> None:
    path = os.path.join(ckpt, "threefold.json")
    with open(path) as f:
        index = json.load(f)
    edit(index)
    with open(path, "w") as f:
        json.dump(index, f)


def _metadata(ckpt: str):
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        return pickle.load(f)         # the test's own file


def _write_metadata(ckpt: str, md) -> None:
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    _reindex(ckpt, ".metadata")


def _replace_meta(ckpt: str, value) -> None:
    """The `meta` entry replaced by `value` (torch.save'd, appended to its file)."""
    md = _metadata(ckpt)
    key = next(i for i in md.storage_data if i.fqn == "meta")
    info = md.storage_data[key]
    buf = io.BytesIO()
    torch.save(value, buf)
    path = os.path.join(ckpt, info.relative_path)
    info.offset, info.length = os.path.getsize(path), len(buf.getvalue())
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    _reindex(ckpt, info.relative_path)
    _write_metadata(ckpt, md)


def _meta_of(ckpt: str) -> dict:
    from threefold.checkpoint.reader import read_checkpoint
    return dict(read_checkpoint(ckpt).meta)


def _save(root: str, extra: dict, step: int = 1) -> str:
    from threefold.models.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)
    x = torch.randint(0, 256, (4, 8))
    pm = threefold.parallelize(GPT(cfg), "tp=1", (x,), lm_loss, target=x.roll(-1, 1))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.step(x, target=x.roll(-1, 1))
    opt.step()
    gen = {"gpt": dataclasses.asdict(cfg), "tokenizer": {"kind": "byte"}, "context": 8}
    return threefold.save(pm, opt, root, step=step, extra={"losses": [1.0], **extra,
                                                           "generate": extra.get("generate", gen)})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "root"
    return _save(str(root), {})


def _copy(saved: str, tmp_path) -> str:
    shutil.copytree(os.path.dirname(saved), str(tmp_path / "c"))
    return str(tmp_path / "c" / os.path.basename(saved))


def _one_line_exit_2(argv, capsys, *words) -> str:
    capsys.readouterr()
    t0 = time.perf_counter()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert time.perf_counter() - t0 < 30
    assert "\n" not in err and "Traceback" not in err, err
    assert all(w in err for w in words), (words, err)
    return err


# -- 1. no data file chooses code ---------------------------------------------------------------

def _payload_module(marker: str) -> str:
    return f"subprocess:run(args='touch {marker}', shell=True)"


def _payload_file(ckpt: str, marker: str) -> str:
    path = os.path.join(os.path.dirname(ckpt), "model.py")   # shipped inside the checkpoint folder
    with open(path, "w") as f:
        f.write(f"import pathlib\npathlib.Path({marker!r}).touch()\n"
                "def workload():\n    raise SystemExit(0)\n")
    return f"{path}:workload"


@pytest.mark.parametrize("payload", ["module", "file-in-folder"])
@pytest.mark.parametrize("trust", [False, True], ids=["plain", "trust-recorded-spec"])
def test_a_recorded_spec_never_runs(tmp_path, capsys, payload, trust):
    marker = str(tmp_path / "MARKER")
    root = tmp_path / "root"
    root.mkdir()
    spec = _payload_module(marker) if payload == "module" else _payload_file(str(root / "step_000000001"), marker)
    ckpt = _save(str(root), {"generate": {"spec": spec, "sizes": {}, "context": 8}})
    argv = ["generate", ckpt, "--prompt", "ab", "--tokens", "2"] + (["--trust-recorded-spec"] if trust else [])
    err = _one_line_exit_2(argv, capsys, spec)
    assert ("--spec" in err) and not os.path.exists(marker), err
    # export reads the record for the embedded GPT's config only: never the SPEC
    assert main(["export", ckpt, "--out", str(tmp_path / "x")]) == 0
    assert not os.path.exists(marker), "the checkpoint's SPEC ran"


def test_a_config_file_spec_is_the_users_command_line(tmp_path):
    """--config FILE is the user's command line (they name the file, like a shell script):
    its SPEC is theirs. Nothing reads a config from a checkpoint or an out dir."""
    from threefold.config import load_config
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nspec = "examples/gpt.py:workload"\n')
    assert load_config(str(cfg)).spec == "examples/gpt.py:workload"


# -- 2. malformed metadata: one line, naming the file and the field ----------------------------

def _fifo_metadata(ckpt):
    os.remove(os.path.join(ckpt, ".metadata"))
    os.mkfifo(os.path.join(ckpt, ".metadata"))
    return ".metadata", "FIFO"


def _fifo_shard(ckpt):
    name = next(n for n in os.listdir(ckpt) if n.endswith(".distcp"))
    os.remove(os.path.join(ckpt, name))
    os.mkfifo(os.path.join(ckpt, name))
    return name, "FIFO"


def _dev_zero(ckpt):
    name = next(n for n in os.listdir(ckpt) if n.endswith(".distcp"))
    os.remove(os.path.join(ckpt, name))
    os.symlink("/dev/zero", os.path.join(ckpt, name))
    return name, "symbolic link"


def _fifo_index(ckpt):
    os.remove(os.path.join(ckpt, "threefold.json"))
    os.mkfifo(os.path.join(ckpt, "threefold.json"))
    return "threefold.json", "FIFO"


def _index_field(field, value):
    def edit(ckpt):
        _edit_index(ckpt, lambda ix: ix.__setitem__(field, value))
        return "threefold.json", field
    edit.__name__ = f"index_{field}_{type(value).__name__}"
    return edit


def _index_entry_int(ckpt):
    _edit_index(ckpt, lambda ix: ix["files"].__setitem__(".metadata", 7))
    return "threefold.json", "files..metadata"


def _index_path_escape(ckpt):
    _edit_index(ckpt, lambda ix: ix["files"].__setitem__("../x", [1, 2]))
    return "threefold.json", "files.../x"


def _meta_as(value, field):
    def edit(ckpt):
        _replace_meta(ckpt, value(_meta_of(ckpt)))
        return ".metadata", field
    edit.__name__ = f"meta_{field}"
    return edit


def _huge_tensor(ckpt):
    md = _metadata(ckpt)
    key = next(k for k in md.state_dict_metadata if k.startswith("model.") and
               len(md.state_dict_metadata[k].size) == 2)
    m = md.state_dict_metadata[key]
    m.size = torch.Size([2**20, 2**20])
    for c in m.chunks:
        c.sizes = torch.Size([2**20, 2**20])
    _write_metadata(ckpt, md)
    return ".metadata", key


def _dotdot_storage(ckpt):
    md = _metadata(ckpt)
    info = next(iter(md.storage_data.values()))
    shutil.copy(os.path.join(ckpt, info.relative_path), os.path.join(os.path.dirname(ckpt), "outside.distcp"))
    info.relative_path = "../outside.distcp"
    _write_metadata(ckpt, md)
    return ".metadata", "outside.distcp"


def _dangling_latest(ckpt):
    with open(os.path.join(os.path.dirname(ckpt), "latest"), "w") as f:
        f.write("step_000000099\n")
    return "latest", "dangling"


def _fifo_latest(ckpt):
    os.remove(os.path.join(os.path.dirname(ckpt), "latest"))
    os.mkfifo(os.path.join(os.path.dirname(ckpt), "latest"))
    return "latest", "FIFO"


CASES = [_fifo_metadata, _fifo_shard, _dev_zero, _fifo_index, _index_field("step", "1"),
         _index_field("world", "2"), _index_field("step", -1), _index_field("step", 2**70),
         _index_entry_int, _index_path_escape,
         _meta_as(lambda m: [m], "meta"), _meta_as(lambda m: {**m, "step": "1"}, "step"),
         _meta_as(lambda m: {**m, "step": -5}, "step"), _meta_as(lambda m: {**m, "step": 10**15}, "step"),
         _meta_as(lambda m: {**m, "extra": {**m["extra"], "losses": ["a", "b"]}}, "extra.losses"),
         _meta_as(lambda m: {**m, "extra": {**m["extra"], "generate": {"gpt": {"n_embd": "x"}}}}, "n_embd"),
         _meta_as(lambda m: {**m, "extra": {**m["extra"], "generate": {
             "gpt": {**m["extra"]["generate"]["gpt"], "block_size": 2**14}, "tokenizer": {"kind": "byte"}}}},
             "block_size"),
         _huge_tensor, _dotdot_storage, _dangling_latest, _fifo_latest]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_malformed_metadata_is_one_line_naming_file_and_field(saved, tmp_path, capsys, case):
    ckpt = _copy(saved, tmp_path)
    file, field = case(ckpt)
    root = os.path.dirname(ckpt)
    target = root if file == "latest" else ckpt
    _one_line_exit_2(["generate", target, "--prompt", "ab", "--tokens", "2"], capsys, file, field)
    _one_line_exit_2(["export", target, "--out", str(tmp_path / "x")], capsys, file)
    assert not os.path.exists(tmp_path / "x")
    # train --resume: refused in the parent, before any rank starts
    if "generate" not in case.__name__ and field not in ("n_embd", "block_size"):
        _one_line_exit_2(["train", "--resume", target, "--steps", "2", "--n-layer", "2", "--n-embd", "16",
                          "--n-head", "2", "--seq", "8", "--batch", "4", "--out", str(tmp_path / "o")],
                         capsys, file)


def test_a_sound_checkpoint_still_generates_and_loads(saved, tmp_path, capsys):
    assert main(["generate", saved, "--prompt", "ab", "--tokens", "3", "--temperature", "0"]) == 0
    assert _meta_of(saved)["step"] == 1
