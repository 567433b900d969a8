"""`--data PATH` -> one flat array of token ids.

What PATH may be, decided by what it is and its name:
- a directory: every `*.txt` and `*.jsonl` file under it (recursively, sorted by path;
  hidden files and folders are skipped);
- `*.jsonl`: one JSON object per line, each with a string `text` field (one document each);
- `*.bin`, `*.u16`, `*.u32`: pre-tokenised ids (as nanoGPT's train.bin), memory-mapped, never
  copied. The element type is `--data-dtype` if not `auto`; else the `dtype` of a sidecar
  `PATH.json` ({"dtype": "uint32"}); else from the name: `.u32` is uint32, `.bin` and `.u16`
  are uint16 (nanoGPT's convention);
- any other file: UTF-8 text, one document.
Documents are tokenised one by one and joined by the tokenizer's encoding of a blank line,
so no token straddles two files.
"""
from __future__ import annotations

import json
import os

import numpy as np

from threefold.dataset import token_cache
from threefold.errors import PlanError
from threefold.regular_file import require_regular_file

TOKEN_SUFFIXES = {".bin": "uint16", ".u16": "uint16", ".u32": "uint32"}
TEXT_SUFFIXES = (".txt", ".jsonl")
SEPARATOR = "\n\n"


def is_token_file(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in TOKEN_SUFFIXES


def read_tokens(path: str, tokenizer, dtype: str = "auto") -> np.ndarray:
    """The ids of everything at `path`, 1-D (a read-only memory map for token files)."""
    if not os.path.exists(path):
        raise PlanError(f"--data {path!r} does not exist: give a text file, a directory of .txt/.jsonl "
                        "files, a .jsonl file or a token-id .bin file")
    if os.path.isdir(path):
        files = sorted(_text_files(path))
        if not files:
            raise PlanError(f"--data {path!r} is a directory without .txt or .jsonl files: "
                            "give a directory that holds some, or a file")
    else:
        files = [path]
    for f in files:
        require_regular_file(f, f"--data {f!r}")
    if is_token_file(path) and not os.path.isdir(path):
        return _memmap(path, dtype)
    if sum(os.path.getsize(f) for f in files) > token_cache.STREAM_BYTES:   # never whole in memory
        return _cached(files, tokenizer, path)
    return _encode([doc for f in files for doc in _documents(f)], tokenizer, path)


def _cached(files: list[str], tokenizer, path: str) -> np.ndarray:
    def pieces():
        for f in files:
            try:
                if f.lower().endswith(".jsonl"):
                    yield from ((True, doc) for doc in _documents(f))
                else:
                    yield from token_cache.text_pieces(f)
            except UnicodeDecodeError:
                raise PlanError(f"--data {f!r} is not UTF-8 text: give UTF-8 text, or token ids as a .bin "
                                "file") from None
    return token_cache.cached_tokens(files, tokenizer, pieces, path)


def _text_files(root: str):
    """*.txt and *.jsonl under root, skipping hidden files and folders (.git, .ipynb_checkpoints)."""
    for d, dirs, names in os.walk(root):
        dirs[:] = [n for n in dirs if not n.startswith(".")]
        yield from (os.path.join(d, n) for n in names if not n.startswith(".") and n.lower().endswith(TEXT_SUFFIXES))


def _documents(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            if not path.lower().endswith(".jsonl"):
                yield f.read()
                return
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except RecursionError:
                    raise PlanError(f"--data {path!r} line {n} nests too deeply: give one flat JSON object "
                                    "per line") from None
                except json.JSONDecodeError as exc:
                    raise PlanError(f"--data {path!r} line {n} is not JSON ({exc.msg}): "
                                    "give one JSON object per line") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise PlanError(f"--data {path!r} line {n} has no string 'text' field: "
                                    'write each line as {"text": "..."}')
                yield row["text"]
    except UnicodeDecodeError:
        raise PlanError(f"--data {path!r} is not UTF-8 text: give UTF-8 text, or token ids as a .bin "
                        "file") from None
    except OSError as exc:
        raise PlanError(f"--data {path!r} cannot be read: {exc.strerror or exc}") from None


def _encode(docs: list[str], tokenizer, path: str) -> np.ndarray:
    docs = [d for d in docs if d]
    if not docs:
        raise PlanError(f"--data {path!r} holds no text: give a non-empty file")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    sep = np.asarray(tokenizer.encode(SEPARATOR), dtype=dtype)
    parts = []     # numpy pieces, not one Python list: a list of ints costs ~30 bytes a token
    for i, doc_ids in enumerate(tokenizer.encode_batch(docs)):
        if i:
            parts.append(sep)
        parts.append(np.asarray(doc_ids, dtype=dtype))
    return np.concatenate(parts)


def token_dtype(path: str, dtype: str = "auto") -> str:
    """The element type of a token-id file (the rule in this module's docstring)."""
    if dtype != "auto":
        return dtype
    sidecar = path + ".json"
    if os.path.exists(sidecar):
        try:
            with open(sidecar, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise PlanError(f"{sidecar!r} is not a JSON file ({exc}): write {{\"dtype\": \"uint16\"}}") from None
        found = meta.get("dtype") if isinstance(meta, dict) else None
        if found not in ("uint16", "uint32"):
            raise PlanError(f"{sidecar!r} has dtype {found!r}: use \"uint16\" or \"uint32\"")
        return found
    return TOKEN_SUFFIXES[os.path.splitext(path)[1].lower()]


def _memmap(path: str, dtype: str) -> np.ndarray:
    kind = token_dtype(path, dtype)
    size = os.path.getsize(path)
    item = np.dtype(kind).itemsize
    if size == 0:
        raise PlanError(f"--data {path!r} is empty: give a file of token ids")
    if size % item:
        raise PlanError(f"--data {path!r} has {size} bytes, not a whole number of {kind} ids: "
                        "check --data-dtype (or the PATH.json sidecar)")
    return np.memmap(path, dtype=kind, mode="r")
