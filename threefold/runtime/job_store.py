"""The job's rendezvous store admits only the job's ranks.

A TCPStore has no authentication: any local process can connect to its port, list its keys
and write them, and one that writes the rendezvous keys (the ranks' gloo addresses, our
failure key) makes every rank of the job fail. So the local launcher makes a random
per-job secret and hands it to its ranks (through the spawn pipe: never on a command line,
never in /proc/*/environ), and every rank and the launcher see the store through
`JobStore(store, secret)`:

- every key lives under a prefix derived from the secret (not the secret itself, which
  `list_keys` would then reveal): a process that writes the usual c10d/gloo keys, or our
  failure key, writes keys the job never reads: it is ignored, and the job runs on;
- every value the job `set`s carries an HMAC-SHA256 of (key, value) under the secret, and
  `get` checks it: a process that lists the keys and overwrites one of the job's is named
  (one line: which key, that a process outside this job wrote it) instead of its bytes
  being used as a peer's address.

Counters (`add`, used by c10d's optional store barrier) cannot carry an HMAC; they are only
namespaced. Under torchrun the store is torchrun's (see `init_from_env`): setting
THREEFOLD_JOB_SECRET to the same random value on every node gives it the same protection.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

import torch.distributed as dist

SECRET_ENV = "THREEFOLD_JOB_SECRET"
_TAG = 32          # hex digits of HMAC kept per value (128 bits)


class ForeignWrite(RuntimeError):
    """A value in the job's store that the job did not write."""


def new_secret() -> str:
    return secrets.token_hex(16)


def namespace(secret: str) -> str:
    return "tfjob-" + hashlib.sha256(b"threefold-namespace\0" + secret.encode()).hexdigest()[:16] + "/"


class JobStore(dist.Store):
    """`inner` seen under the job's namespace, with authenticated values (module docstring)."""

    def __init__(self, inner, secret: str):
        super().__init__()
        self._key = hashlib.sha256(b"threefold-mac\0" + secret.encode()).digest()
        self._inner = dist.PrefixStore(namespace(secret), inner)

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).hexdigest()[:_TAG].encode()

    def _wrap(self, key: str, value) -> bytes:
        value = value.encode() if isinstance(value, str) else bytes(value)
        return self._tag(key, value) + b":" + value

    def _unwrap(self, key: str, raw: bytes) -> bytes:
        tag, sep, value = bytes(raw).partition(b":")
        if not (sep and hmac.compare_digest(tag, self._tag(key, value))):
            raise ForeignWrite(f"rendezvous store key {key!r} holds a value this job did not write: another "
                               "process on this machine wrote into the job's store; the value was not used")
        return value

    def set(self, key, value):
        self._inner.set(key, self._wrap(key, value))

    def get(self, key):
        return self._unwrap(key, self._inner.get(key))

    def compare_set(self, key, expected, desired):
        expected = self._wrap(key, expected) if len(expected) else b""
        return self._unwrap(key, self._inner.compare_set(key, expected, self._wrap(key, desired)))

    def add(self, key, amount):
        return self._inner.add(key, amount)

    def wait(self, keys, timeout=None):
        return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def check(self, keys):
        return self._inner.check(keys)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        return self._inner.set_timeout(timeout)
