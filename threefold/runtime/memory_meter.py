"""Count the bytes a block of code allocates, on any device (meta included): live bytes
and their peak, and at the peak how much of it was gradients and optimizer state.

A TorchDispatchMode sees every op's outputs; each new storage is counted until it is
freed (a weakref finalizer). Gradients and optimizer state are read off the parameters
and the optimizer when the count reaches a new peak (rounded: every 1% of growth), so the
rest of the peak is activations and temporaries (runtime/dry_run.py's categories).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StepMeter(TorchDispatchMode):
    def __init__(self, params: list[torch.Tensor], optimizer=None):
        super().__init__()
        self.params, self.optimizer = params, optimizer
        self.live = 0
        self.peak = 0
        self.at_peak = {"grads": 0, "optimizer": 0}
        self._seen: set[int] = set()
        self._next_snapshot = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage) if t.is_meta else storage.data_ptr()
        if t.is_meta:   # meta storages have no address: the storage object is the identity
            key = ("meta", storage._cdata)
        if key in self._seen:
            return
        n = storage.nbytes()
        self._seen.add(key)
        self.live += n
        weakref.finalize(storage, self._free, key, n) if not t.is_meta else weakref.finalize(t, self._free, key, n)
        if self.live > self.peak:
            self.peak = self.live
            if self.live >= self._next_snapshot:
                self.at_peak = {"grads": self._grads(), "optimizer": self._optimizer_state()}
                self._next_snapshot = int(self.live * 1.01) + 1

    def _free(self, key, n: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= n

    def _grads(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)

    def _optimizer_state(self) -> int:
        opt = self.optimizer
        while opt is not None and not isinstance(opt, torch.optim.Optimizer):
            opt = getattr(opt, "optimizer", None) or getattr(opt, "inner", None)
        if opt is None:
            return 0
        return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
