"""Tokenizers for `--tokenizer`: the byte-level default, or a local Hugging Face tokenizer.

Both have `name`, `vocab_size`, `encode(text) -> list[int]`, `encode_batch(texts)` and
`decode(ids) -> str`. A Hugging Face tokenizer is read from a directory holding
`tokenizer.json` (what `tokenizer.save_pretrained(DIR)` or `Tokenizer.save(DIR/tokenizer.json)`
writes), with the `tokenizers` package; nothing is downloaded.
"""
from __future__ import annotations

import os

import numpy as np

from threefold.errors import PlanError

BYTE = "byte"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: no vocabulary file, every text encodes."""

    name = BYTE
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]   # no per-id objects

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": BYTE}


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local tokenizer.json."""

    def __init__(self, path: str, tok):
        self.name = path
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_dict(self) -> dict:
        """The whole tokenizer as JSON-able data (for a checkpoint: generate needs no DIR)."""
        return {"kind": "hf", "name": self.name, "tokenizer_json": self._tok.to_str()}


def tokenizer_from_dict(d: dict) -> ByteTokenizer | HFTokenizer:
    """The tokenizer `to_dict()` described."""
    if d.get("kind") == BYTE:
        return ByteTokenizer()
    if d.get("kind") == "hf":
        from tokenizers import Tokenizer   # lazy: tokenizers loads only when a tokenizer is built
        return HFTokenizer(d.get("name", "hf"), Tokenizer.from_str(d["tokenizer_json"]))
    raise PlanError(f"tokenizer record {str(d)[:60]!r} is neither byte nor hf: the checkpoint is damaged")


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'byte', or a directory with tokenizer.json (or the tokenizer.json file itself)."""
    if spec == BYTE:
        return ByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.exists(spec):
        raise PlanError(f"--tokenizer {spec!r} does not exist: give 'byte' or a local Hugging Face "
                        "tokenizer directory (with tokenizer.json)")
    if not os.path.isfile(path):
        raise PlanError(f"--tokenizer {spec!r} has no tokenizer.json: give a directory written by "
                        "save_pretrained() or Tokenizer.save(), or 'byte'")
    try:
        from tokenizers import Tokenizer   # lazy: tokenizers loads only when a tokenizer is built
    except ModuleNotFoundError:
        raise PlanError("--tokenizer DIR needs the 'tokenizers' package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:   # the Rust side raises a plain Exception for a bad file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlanError(f"--tokenizer {spec!r}: {path} is not a tokenizers file ({first})") from None
    return HFTokenizer(spec, tok)
