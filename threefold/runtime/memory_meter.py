"""Count the bytes a block of code allocates, on any device (meta included): live bytes
and their peak, and at the peak how much of it was gradients and optimizer state.

A TorchDispatchMode sees every op's outputs; each new storage is counted until it is
freed (weakref finalizers on the tensors seen on it). Gradients and optimizer state are read off the parameters
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
        self._refs: dict[int, list[int]] = {}    # storage -> [tensors seen on it alive, bytes]
        self._next_snapshot = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        """Count `t`'s storage once; it is freed when the last tensor seen on it is (a view
        can outlive its base)."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata          # the StorageImpl: one per storage, also for meta tensors
        refs = self._refs.get(key)
        if refs is None:
            n = storage.nbytes()
            self._refs[key] = [1, n]
            self.live += n
            if self.live > self.peak:
                self.peak = self.live
                if self.live >= self._next_snapshot:
                    self.at_peak = {"grads": self._grads(), "optimizer": self._optimizer_state()}
                    self._next_snapshot = int(self.live * 1.01) + 1
        else:
            refs[0] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key) -> None:
        refs = self._refs.get(key)
        if refs is not None:
            refs[0] -= 1
            if refs[0] == 0:
                del self._refs[key]
                self.live -= refs[1]

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
