"""threefold.dataset: sources (text, directory, JSON lines, memory-mapped token ids), the
byte and local Hugging Face tokenizers, the split, and the sampler (determinism, dp sharding,
resume position). All single-process and quick."""
import json
import os

import numpy as np
import pytest
import torch

from threefold.config import load_config
from threefold.dataset import (ByteTokenizer, Sampler, fixed_batches, load_data, load_tokenizer, read_tokens,
                               tokenizer_from_dict)
from threefold.dataset.sources import SEPARATOR
from threefold.errors import PlanError

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def _write_bytes(path, data):
    path.write_bytes(data)
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here, saved to a directory (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT, "hello world " * 20], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return str(d)


# ---- tokenizers ----------------------------------------------------------------------------

def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "naïve café – ✓"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and max(ids) < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tokenizer_from_dict(tok.to_dict()).encode(text) == ids


def test_local_hf_tokenizer_loads_encodes_and_rebuilds_from_its_record(hf_dir):
    tok = load_tokenizer(hf_dir)
    ids = tok.encode("the lazy dog")
    assert 256 < tok.vocab_size <= 300
    assert len(ids) < len("the lazy dog")           # merges learned: fewer ids than bytes
    assert tok.decode(ids) == "the lazy dog"
    again = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.encode("the lazy dog") == ids and again.vocab_size == tok.vocab_size
    assert load_tokenizer(os.path.join(hf_dir, "tokenizer.json")).encode("dog") == tok.encode("dog")


@pytest.mark.parametrize("kind", ["missing", "no tokenizer.json", "not a tokenizer"])
def test_bad_tokenizer_is_one_line(tmp_path, kind):
    if kind == "missing":
        spec = str(tmp_path / "nope")
    elif kind == "no tokenizer.json":
        spec = str(tmp_path)
    else:
        _write(tmp_path / "tokenizer.json", "{not json")
        spec = str(tmp_path)
    with pytest.raises(PlanError, match="--tokenizer") as e:
        load_tokenizer(spec)
    assert "\n" not in str(e.value)


def test_text_data_with_a_local_tokenizer(tmp_path, hf_dir):
    cfg = load_config(None, {"data": _write(tmp_path / "t.txt", TEXT), "tokenizer": hf_dir, "seq": 8})
    d = load_data(cfg)
    assert d.vocab_size == load_tokenizer(hf_dir).vocab_size > 256
    assert int(max(d.train.max(), d.val.max())) < d.vocab_size
    assert len(d.train) + len(d.val) < len(TEXT) / 2            # merges: far fewer ids than bytes
    assert d.tokenizer.decode(d.train[:9]) == TEXT[:len(d.tokenizer.decode(d.train[:9]))]


def test_pretokenised_bin_gives_the_same_batches_as_its_text(tmp_path, hf_dir):
    text_cfg = load_config(None, {"data": _write(tmp_path / "t.txt", TEXT), "tokenizer": hf_dir, "seq": 8})
    ids = np.concatenate([load_data(text_cfg).train, load_data(text_cfg).val])
    ids.astype(np.uint16).tofile(tmp_path / "t.bin")          # what a nanoGPT-style prepare script writes
    bin_cfg = load_config(None, {"data": str(tmp_path / "t.bin"), "tokenizer": hf_dir, "seq": 8})
    a, b = load_data(text_cfg), load_data(bin_cfg)
    assert torch.equal(a.sampler(text_cfg).next()[0], b.sampler(bin_cfg).next()[0])
    assert all(torch.equal(x[1], y[1]) for x, y in zip(a.val_batches(text_cfg), b.val_batches(bin_cfg)))


def test_data_dtype_is_refused_for_text(tmp_path):
    cfg = load_config(None, {"data": _write(tmp_path / "t.txt", TEXT), "data_dtype": "uint32"})
    with pytest.raises(PlanError, match="--data-dtype uint32 applies to token-id files"):
        load_data(cfg)


# ---- sources -------------------------------------------------------------------------------

def test_text_file_directory_and_jsonl_sources(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "d" / "sub").mkdir(parents=True)
    a = _write(tmp_path / "d" / "a.txt", "alpha")
    _write(tmp_path / "d" / "sub" / "b.txt", "beta")
    _write(tmp_path / "d" / "c.jsonl", '{"text": "gamma"}\n\n{"text": "delta", "id": 3}\n')
    _write(tmp_path / "d" / "skip.csv", "not read")
    (tmp_path / "d" / ".git").mkdir()
    _write(tmp_path / "d" / ".git" / "notes.txt", "hidden")
    assert tok.decode(read_tokens(a, tok)) == "alpha"
    # sorted by path: a.txt, c.jsonl (two documents), sub/b.txt; documents joined by a blank line
    joined = tok.decode(read_tokens(str(tmp_path / "d"), tok))
    assert joined == SEPARATOR.join(["alpha", "gamma", "delta", "beta"])
    assert tok.decode(read_tokens(str(tmp_path / "d" / "c.jsonl"), tok)) == "gamma" + SEPARATOR + "delta"


def test_token_files_are_memory_mapped_with_the_documented_dtype_rule(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 256
    ids.tofile(tmp_path / "train.bin")
    got = read_tokens(str(tmp_path / "train.bin"), ByteTokenizer())
    assert isinstance(got, np.memmap) and got.dtype == np.uint16 and np.array_equal(got, ids)
    big = np.arange(70000, 70010, dtype=np.uint32)
    big.tofile(tmp_path / "ids.u32")
    assert np.array_equal(read_tokens(str(tmp_path / "ids.u32"), ByteTokenizer()), big)
    big.tofile(tmp_path / "wide.bin")            # a .bin of uint32 ids: the sidecar says so
    (tmp_path / "wide.bin.json").write_text('{"dtype": "uint32"}')
    assert np.array_equal(read_tokens(str(tmp_path / "wide.bin"), ByteTokenizer()), big)
    assert read_tokens(str(tmp_path / "wide.bin"), ByteTokenizer(), dtype="uint16").dtype == np.uint16


def test_bin_ids_are_checked_against_the_vocabulary(tmp_path):
    np.array([1, 2, 300, 4] * 100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    cfg = load_config(None, {"data": str(tmp_path / "t.bin"), "seq": 8})
    with pytest.raises(PlanError, match=r"token id 300 .*position 2.*256 ids"):
        load_data(cfg)


BAD = {
    "missing file": (lambda p: str(p / "none.txt"), "does not exist"),
    "empty text": (lambda p: _write(p / "e.txt", ""), "holds no text"),
    "empty dir": (lambda p: str(p), "without .txt or .jsonl"),
    "empty bin": (lambda p: _write_bytes(p / "e.bin", b""), "is empty"),
    "odd bin size": (lambda p: _write_bytes(p / "o.bin", b"abc"), "whole number"),
    "bad jsonl": (lambda p: _write(p / "j.jsonl", '{"text": "a"}\nnope\n'), "line 2 is not JSON"),
    "jsonl no text": (lambda p: _write(p / "j.jsonl", '{"body": "a"}\n'), "no string 'text'"),
    "not utf-8": (lambda p: _write_bytes(p / "b.txt", b"\xff\xfe\x00"), "UTF-8"),
    "shorter than seq": (lambda p: _write(p / "s.txt", "x" * 40), "fewer than seq\\+1"),
    "validation shorter than seq": (lambda p: _write(p / "v.txt", "x" * 300), "validation tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_data_is_one_line(tmp_path, case):
    make, match = BAD[case]
    cfg = load_config(None, {"data": make(tmp_path), "seq": 64})
    with pytest.raises(PlanError, match=match) as e:
        load_data(cfg)
    assert "\n" not in str(e.value)


# ---- split and sampler ---------------------------------------------------------------------

def test_split_is_the_tail_and_deterministic(tmp_path):
    path = _write(tmp_path / "t.txt", "".join(chr(97 + i % 26) for i in range(5000)))
    cfg = load_config(None, {"data": path, "val_fraction": 0.2, "seq": 16})
    d = load_data(cfg)
    assert len(d.val) == 1000 and len(d.train) == 4000
    assert np.array_equal(np.concatenate([d.train, d.val]), read_tokens(path, ByteTokenizer()))
    v1, v2 = d.val_batches(cfg), load_data(cfg).val_batches(cfg)
    assert len(v1) == cfg.eval_batches and all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2))
    x, y = v1[-1]
    assert x.shape == (cfg.batch, 16) and torch.equal(x[:, 1:], y[:, :-1])   # targets: the next token
    assert load_data(load_config(None, {"data": path, "val_fraction": 0.0, "seq": 16})).val_batches(cfg) == []


def _tokens(n=3001):
    return np.arange(n, dtype=np.uint32)      # ids equal positions: windows are easy to read


def test_sampler_is_deterministic_and_visits_every_window_once_per_epoch():
    a, b, c = Sampler(_tokens(), 8, 10, seed=1), Sampler(_tokens(), 8, 10, seed=1), Sampler(_tokens(), 8, 10, seed=2)
    xa, xb, xc = a.next()[0], b.next()[0], c.next()[0]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    s = Sampler(_tokens(), 4, 10, seed=0)
    starts = s.starts(0, s.count)
    offset = starts[0] % 10
    assert sorted(starts) == [offset + 10 * k for k in range(s.count)]    # each window once
    assert s.starts(s.count, s.count) != starts                           # the next epoch differs
    x, y = s.next()
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(x[:, 0], torch.tensor(starts[:4]))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_rows_are_the_engines_slice_of_the_same_global_batch(dp):
    whole = Sampler(_tokens(), 8, 10, seed=3)
    ranks = [Sampler(_tokens(), 8, 10, seed=3) for _ in range(dp)]
    for _ in range(3):
        gx, gy = whole.next()
        for r, s in enumerate(ranks):
            x, y = s.next_rows(r, dp)
            assert torch.equal(x, gx.chunk(dp)[r]) and torch.equal(y, gy.chunk(dp)[r])
    assert all(s.position == whole.position for s in ranks)
    with pytest.raises(PlanError, match="divisible by dp=3"):
        ranks[0].next_rows(0, 3)


def test_resumed_sampler_sees_the_same_batches():
    run = Sampler(_tokens(), 6, 10, seed=5)
    for _ in range(7):
        run.next()
    saved = json.loads(json.dumps(run.state_dict()))   # as it travels in a checkpoint
    rest = [run.next()[0] for _ in range(5)]
    resumed = Sampler(_tokens(), 6, 10, seed=5)
    resumed.load_state_dict(saved)
    assert all(torch.equal(resumed.next()[0], x) for x in rest)
    # another batch size continues at the same sequence: two batches of 3 = one of 6
    half = Sampler(_tokens(), 3, 10, seed=5)
    half.load_state_dict(saved)
    assert torch.equal(torch.cat([half.next()[0], half.next()[0]]), rest[0])
    with pytest.raises(PlanError, match="seed=5"):
        Sampler(_tokens(), 6, 10, seed=6).load_state_dict(saved)


def test_fixed_batches_cover_the_split_evenly():
    toks = _tokens(1000)
    batches = fixed_batches(toks, 4, 10, 3)
    firsts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert firsts[0] == 0 and firsts[-1] == 1000 - 11 and firsts == sorted(firsts)
