"""Count the bytes a block of code allocates, on any device (meta included): live bytes
and their peak, and at the peak how much of it was gradients, optimizer state and
communication buffers.

A TorchDispatchMode sees every op's outputs; each new storage is counted until it is
freed (weakref finalizers on the tensors seen on it). At each new peak (rounded: every 1%
of growth) the live bytes are split into the categories of the memory model
(planner/memory.py):

  grads        read off the parameters (and the optimizer's gradient shards);
  optimizer    the optimizer's state tensors that the block allocated;
  buffers      communication: storages a collective or point-to-point op (c10d) touched
               that autograd has not saved for backward (received boundary tensors, flat
               gradient buckets, gathered or reduced copies in flight);
  activations  the rest: what autograd keeps for backward and the step's temporaries.

Optimizer state that exists before the block (a steady-state step) is not allocated in it:
the caller adds it (runtime/dry_run.py).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COMM_NAMESPACES = ("c10d", "_c10d_functional")


class StepMeter(TorchDispatchMode):
    def __init__(self, params: list[torch.Tensor], optimizer=None):
        super().__init__()
        self.params, self.optimizer = params, optimizer
        self.live = 0
        self.peak = 0
        self.at_peak = {"grads": 0, "optimizer": 0, "buffers": 0}
        self._refs: dict[int, list[int]] = {}    # storage -> [tensors seen on it alive, bytes]
        self._comm: set[int] = set()             # storages a collective or p2p op touched
        self._saved: set[int] = set()            # storages autograd saved for backward
        self._next_snapshot = 0
        self._state_before = _state_keys(optimizer)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)

    def _pack(self, t):
        key = _key(t)
        if key is not None:
            self._saved.add(key)
        # a detached alias: the same storage without t's grad_fn (t itself, a saved output,
        # would hold its own grad_fn: a cycle that frees the step's graph only at gc)
        return t.detach()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {_key(t) for t in _tensors(args)}
        if kwargs:
            inputs.update(_key(t) for t in _tensors(kwargs.values()))
        if func.namespace in _COMM_NAMESPACES:
            self._comm.update(k for k in inputs if k is not None)
        out = func(*args, **(kwargs or {}))
        for t in _tensors((out,)):
            self._count(t, inputs)
        return out

    def _count(self, t: torch.Tensor, inputs: set) -> None:
        """Count `t`'s storage once; it is freed when the last tensor seen on it is (a view
        can outlive its base). A view of a storage that existed before the block (a
        parameter's transpose) is not new memory."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata          # the StorageImpl: one per storage, also for meta tensors
        refs = self._refs.get(key)
        if refs is None and key in inputs:
            return
        if refs is None:
            n = storage.nbytes()
            self._refs[key] = [1, n]
            self.live += n
            if self.live > self.peak:
                self.peak = self.live
                if self.live >= self._next_snapshot:
                    self.at_peak = self._split()
                    self._next_snapshot = int(self.live * 1.01) + 1
        else:
            refs[0] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key) -> None:
        refs = self._refs.get(key)
        if refs is not None:
            refs[0] -= 1
            if refs[0] == 0:   # freed: its key may name a new storage from now on
                del self._refs[key]
                self.live -= refs[1]
                self._comm.discard(key)
                self._saved.discard(key)

    def _split(self) -> dict[str, int]:
        """The categories of what the block holds now (see the module doc)."""
        grads = _grads(self.params, self.optimizer)
        state = {k: t for k, t in _state(self.optimizer).items() if k not in self._state_before}
        known = set(grads) | set(state)
        comm = sum(self._refs[k][1] for k in self._comm
                   if k in self._refs and k not in self._saved and k not in known)
        return {"grads": sum(grads.values()), "optimizer": sum(state.values()), "buffers": comm}


def _unpack(t):
    return t


def _tensors(items):
    """The tensors in `items` and in the lists, tuples and dicts inside it (what an op's
    arguments and outputs hold; a plain walk: this runs for every op of a dry run)."""
    for x in items:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from _tensors(x)
        elif isinstance(x, dict):
            yield from _tensors(x.values())


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _grads(params: list[torch.Tensor], optimizer) -> dict[int, int]:
    """Gradient storages -> bytes: the parameters' and (ZeRO) the optimizer's row shards'."""
    out = {}
    for p in params:
        if p.grad is not None:
            out[_key(p.grad)] = p.grad.untyped_storage().nbytes()
    sharded = getattr(getattr(optimizer, "engine", None), "sharded", None)
    for g in (getattr(sharded, "grads", None) or {}).values():   # zero>=2: the reduced row shards
        if isinstance(g, torch.Tensor):
            out.setdefault(_key(g), g.untyped_storage().nbytes())
    return out


def torch_optimizer(opt):
    """The torch.optim.Optimizer inside threefold's wrappers (runtime/optimizers.py)."""
    while opt is not None and not isinstance(opt, torch.optim.Optimizer):
        opt = getattr(opt, "optimizer", None) or getattr(opt, "inner", None)
    return opt


def _state(optimizer) -> dict[int, int]:
    opt = torch_optimizer(optimizer)
    if opt is None:
        return {}
    return {_key(v): v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)}


def _state_keys(optimizer) -> frozenset:
    return frozenset(_state(optimizer))


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors (each storage once)."""
    return sum(_state(optimizer).values())
