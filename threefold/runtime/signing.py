"""Optional artifact signing with the user's own key: `compile --sign KEY`, `run --verify KEY`.

An artifact is code (runtime/loader.py): its manifest holds the sha256 of every file, so
the manifest alone decides what runs. Those hashes prove the files are the manifest's, not
who wrote the manifest: anyone who edits a module can re-hash it. A signature is
HMAC-SHA256 over the manifest's bytes under a key only its owner holds (any file of at
least 16 bytes, e.g. `head -c 32 /dev/urandom > ~/.threefold.key`), written beside it as
`manifest.json.hmac`. `run --verify KEY` checks it before anything else is read, then
checks every file against the (now authenticated) hashes, so a tampered and re-hashed
artifact is refused in one line. HMAC, not public-key signatures: the one who compiles and
the one who runs share the key (the same user, or a team's secret).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat

from threefold.errors import PlanError

SIGNATURE = "manifest.json.hmac"
FORMAT = "threefold-signature"
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 1 << 16


def read_key(path: str, flag: str) -> bytes:
    """The key in file `path` (its raw bytes)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PlanError(f"{flag} {path}: cannot read the key file ({exc.strerror}); "
                        "make one with: head -c 32 /dev/urandom > KEYFILE") from None
    if not stat.S_ISREG(st.st_mode):
        raise PlanError(f"{flag} {path} is not a regular file: pass the key file itself")
    if st.st_size > MAX_KEY_BYTES:
        raise PlanError(f"{flag} {path} is {st.st_size} bytes, not a key (at most {MAX_KEY_BYTES}): "
                        "pass the key file, e.g. 32 random bytes")
    with open(path, "rb") as f:
        key = f.read(MAX_KEY_BYTES + 1)
    if len(key) < MIN_KEY_BYTES:
        raise PlanError(f"{flag} {path} holds {len(key)} bytes, too few for a key (at least "
                        f"{MIN_KEY_BYTES}): make one with: head -c 32 /dev/urandom > {path}")
    return key


def mac(key: bytes, manifest_bytes: bytes) -> str:
    return hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()


def sign(directory: str, key: bytes, manifest_name: str = "manifest.json") -> None:
    """Write the signature of `directory`'s manifest beside it."""
    with open(os.path.join(directory, manifest_name), "rb") as f:
        data = f.read()
    with open(os.path.join(directory, SIGNATURE), "w") as f:
        json.dump({"format": FORMAT, "algorithm": "hmac-sha256", "hmac": mac(key, data)}, f)


def verify(root: str, manifest_bytes: bytes, key: bytes) -> None:
    """Refuse (one line) unless `manifest_bytes` carry a valid signature under `key`."""
    path = os.path.join(root, SIGNATURE)
    if not os.path.isfile(path) or os.path.islink(path):
        raise PlanError(f"artifact {root!r} is not signed (no {SIGNATURE}): compile it with --sign KEYFILE, "
                        "or run it without --verify if you trust where it came from")
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(4096))
        expected = record["hmac"]
        ok = (record.get("format") == FORMAT and isinstance(expected, str)
              and hmac.compare_digest(expected.encode(), mac(key, manifest_bytes).encode()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise PlanError(f"artifact {root!r}: its manifest does not match its signature under this key "
                        "(the artifact was modified after signing, or signed with another key): refused, "
                        "nothing was imported")
