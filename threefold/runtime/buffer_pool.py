"""Receive buffers kept across microbatches and steps.

A pipeline rank receives the same boundary shapes every microbatch. Allocating each receive
afresh costs page faults whenever malloc hands back new memory (always for blocks over
32 MiB, which glibc mmaps per allocation; see runtime/allocator.py). The pool keeps every
buffer it made, keyed by (shape, dtype, device), and hands out one nobody uses any more.

"Nobody uses it" is read off the storage's reference count, not from bookkeeping: the pool
gives out a detached alias (a new tensor on the same storage), and everything that can
still read the bytes (the alias itself, autograd's saved tensors, a view, a pending
transfer) holds a reference to the storage. So a buffer is reused exactly when its last
reader is gone, whatever the schedule, and never while one remains.
"""
from __future__ import annotations

import torch


_use_count = torch._C._storage_Use_Count     # of a storage's address (_cdata)


def _storage_refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


class BufferPool:
    def __init__(self):
        # key -> (buffer, idle refs, its storage's address). The address is read once: the
        # pool's own tensor keeps that storage (aliases are handed out, never the buffer),
        # and a take checks every busy buffer before a free one (~9 per message, interleaved)
        self._buffers: dict[tuple, list[tuple[torch.Tensor, int, int]]] = {}
        self.allocated = 0      # buffers made (for tests and benches)
        self.reused = 0         # handed out again

    def take(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A tensor of `shape` and `dtype` whose contents are garbage, like torch.empty."""
        key = (shape if type(shape) is tuple else tuple(shape), dtype,
               device if isinstance(device, torch.device) else torch.device(device))
        held = self._buffers.get(key)
        if held is None:
            held = self._buffers[key] = []
        for buf, idle, storage in held:      # the first free one, oldest first
            if _use_count(storage) == idle:
                self.reused += 1
                return buf.detach()
        buf = torch.empty(key[0], dtype=dtype, device=key[2])
        held.append((buf, _storage_refs(buf), buf.untyped_storage()._cdata))
        self.allocated += 1
        return buf.detach()

    def nbytes(self) -> int:
        """Bytes the pool holds (its buffers live as long as the pool)."""
        return sum(b.numel() * b.element_size() for held in self._buffers.values() for b, _, _ in held)
