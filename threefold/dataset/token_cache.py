"""Large text `--data` without reading it whole: tokenised once, in pieces, into a cache file
that every process memory-maps.

Text up to STREAM_BYTES is tokenised in memory as before (sources.py). Above it, the
documents are read STREAM_CHUNK characters at a time (cut at line ends), encoded and
appended to a token-id file in the user's cache (THREEFOLD_CACHE_DIR, else
$XDG_CACHE_HOME/threefold, else ~/.cache/threefold), named by a hash of the files (path,
size, modification time) and the tokenizer; the launcher's parent writes it while checking
the data, the ranks find it and map it. So a process holds a few chunks, never the corpus,
and the pages of the map it touches are the windows it samples.
The ids equal the in-memory path's for the byte tokenizer; a subword tokenizer sees the text
cut at line ends every STREAM_CHUNK characters (a merge across such a line end is lost).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

from threefold.errors import PlanError

STREAM_BYTES = 16 << 20     # text above this many bytes is streamed through the cache (in memory it costs ~3x)
STREAM_CHUNK = 4 << 20      # characters encoded at once
SCAN_CHUNK = 8 << 20        # bytes read at once when scanning a token file
FORMAT = 1                  # bump when the cache's contents would change


def cache_dir() -> str:
    root = os.environ.get("THREEFOLD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "threefold")
    return os.path.join(root, "tokens")


def id_dtype(vocab_size: int):
    return np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _identity(files: list[str], tokenizer) -> str:
    stats = []
    for f in files:
        st = os.stat(f)
        stats.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    tok = tokenizer.to_dict()
    tok_id = hashlib.sha256(json.dumps(tok, sort_keys=True).encode()).hexdigest()
    blob = json.dumps({"format": FORMAT, "files": stats, "tokenizer": tok_id, "chunk": STREAM_CHUNK})
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached_tokens(files: list[str], tokenizer, pieces, path: str) -> np.ndarray:
    """The ids of `files` (pieces(): (starts_a_document, text) in order), as a read-only map
    of the cache file, written first if it is not there."""
    dtype = id_dtype(tokenizer.vocab_size)
    target = os.path.join(cache_dir(), f"{_identity(files, tokenizer)}.{np.dtype(dtype).name}")
    if not os.path.isfile(target):
        _write(target, tokenizer, pieces, dtype, path)
    if os.path.getsize(target) == 0:
        raise PlanError(f"--data {path!r} holds no text: give a non-empty file")
    return np.memmap(target, dtype=dtype, mode="r")


def _write(target: str, tokenizer, pieces, dtype, path: str) -> None:
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tokens-", dir=os.path.dirname(target))
    except OSError as exc:
        raise PlanError(f"--data {path!r} is large and is tokenised into {os.path.dirname(target)}, which "
                        f"cannot be written ({exc.strerror or exc}): set THREEFOLD_CACHE_DIR to a writable "
                        "directory") from None
    sep = np.asarray(tokenizer.encode("\n\n"), dtype=dtype).tobytes()
    try:
        with os.fdopen(fd, "wb") as out:
            wrote = False
            pending, size = [], 0

            def flush():
                nonlocal wrote
                ids = tokenizer.encode_batch([t for _, t in pending])
                for (new_doc, _), piece in zip(pending, ids):
                    if new_doc and wrote:
                        out.write(sep)
                    out.write(np.asarray(piece, dtype=dtype).tobytes())
                    wrote = True
                pending.clear()
            for new_doc, text in pieces():
                if not text:
                    continue
                pending.append((new_doc, text))
                size += len(text)
                if size >= STREAM_CHUNK:
                    flush()
                    size = 0
            if pending:
                flush()
        os.replace(tmp, target)    # whole or not at all; a concurrent writer wrote the same ids
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        # lazy: start-up: outdir loads only on this path
        from threefold.outdir import disk_full, is_disk_full
        if isinstance(exc, OSError) and is_disk_full(exc):
            raise PlanError(f"--data {path!r}: tokenising it into {os.path.dirname(target)} failed: "
                            f"{disk_full()} (or set THREEFOLD_CACHE_DIR)") from None
        raise


def text_pieces(path: str):
    """(starts_a_document, text) of one UTF-8 text file, STREAM_CHUNK characters at a time,
    cut after a line end (or mid-line for a line longer than that)."""
    with open(path, encoding="utf-8") as f:    # newlines as the in-memory path reads them
        first, buf, size = True, [], 0
        while True:
            block = f.read(STREAM_CHUNK)
            if not block:
                break
            cut = block.rfind("\n") + 1 if len(block) == STREAM_CHUNK else len(block)
            cut = cut or len(block)
            buf.append(block[:cut])
            yield first, "".join(buf)
            first, buf = False, [block[cut:]]
        tail = "".join(buf)
        if tail:
            yield first, tail


def scan_ids(tokens: np.ndarray, vocab_size: int) -> tuple[int, int | None]:
    """(largest id, position of the first id >= vocab_size or None). A memory map is read
    through the file in SCAN_CHUNK pieces, so its pages never become this process's memory."""
    if not isinstance(tokens, np.memmap) or not getattr(tokens, "filename", None):
        arr = np.asarray(tokens)
        top = int(arr.max())
        return top, (int(np.argmax(arr >= vocab_size)) if top >= vocab_size else None)
    top, first_bad, done = 0, None, 0
    item = tokens.dtype.itemsize
    with open(tokens.filename, "rb") as f:
        f.seek(tokens.offset)
        while done < len(tokens):
            n = min(SCAN_CHUNK // item, len(tokens) - done)
            part = np.frombuffer(f.read(n * item), dtype=tokens.dtype)
            if len(part) == 0:
                break
            m = int(part.max())
            if m >= vocab_size and first_bad is None:
                first_bad = done + int(np.argmax(part >= vocab_size))
            top, done = max(top, m), done + len(part)
    return top, first_bad
