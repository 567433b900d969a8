"""Measured activation memory: what autograd really keeps for backward.

`SavedTensorCounter` counts, while it is active, every tensor storage autograd saves for
backward (torch.autograd.graph.saved_tensors_hooks), each unique storage once (by its
untyped_storage data_ptr, so views of one tensor count once) and its whole storage's bytes.
It trusts no model of the ops: it sees what the autograd functions actually save. Storages
given in `exclude` (parameters, buffers) are not activations and are not counted.

Activation recomputation (ChunkModule.recompute) runs under torch.utils.checkpoint, which
installs its own hooks (so the ops it will recompute are, correctly, not counted) and keeps
its inputs by reference rather than through the hooks; it reports them with `note_held`.

Count a forward pass (the storages counted are alive until backward, so their pointers are
unique); the backward's recomputation is not counted.
"""
from __future__ import annotations

import weakref

import torch

_ACTIVE: list["_Counting"] = []


class _Counting:
    """A counter live inside `with`: its saved-tensor hooks installed and itself on _ACTIVE
    (where tensors held outside the hooks find it)."""
    _hooks: torch.autograd.graph.saved_tensors_hooks

    def __enter__(self):
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)


class SavedTensorCounter(_Counting):
    """with SavedTensorCounter(exclude=model.parameters()) as c: loss = f(x)  ->  c.bytes"""

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}     # data_ptr -> bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def count(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._excluded:
            self.storages.setdefault(ptr, storage.nbytes())

    def _pack(self, t):
        self.count(t)
        return t


def note_held(values) -> None:
    """Tensors kept for backward outside the saved-tensor hooks (a checkpoint's inputs)."""
    for counter in _ACTIVE:
        for v in values:
            counter.count(v)


# ---- peak over a whole step -------------------------------------------------------------------
class _Saved:
    """What a saved-tensor pack hook hands autograd: released when autograd drops it."""
    __slots__ = ("t", "counter", "key")

    def __init__(self, t, counter, key):
        self.t, self.counter, self.key = t, counter, key

    def __del__(self):
        self.counter._release(self.key)


class PeakSavedCounter(_Counting):
    """with PeakSavedCounter(exclude=state) as c: pm.step(...)  ->  c.peak_bytes

    The most bytes of unique storages saved for backward that are alive at one time, over
    everything run under it (every microbatch of a pipeline schedule, in the engine's real
    order). A storage counts from the first time autograd saves it until autograd has
    released every saved reference to it (backward frees them, or the graph is dropped);
    a recomputed segment's inputs (note_held) count until the segment's tensors die. It
    models nothing: it watches autograd."""

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.live = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t)

    def _acquire(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if not key or key in self._excluded:
            return None
        if self._refs.get(key, 0) == 0:
            self._bytes[key] = storage.nbytes()
            self.live += self._bytes[key]
            self.peak_bytes = max(self.peak_bytes, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        return key

    def _release(self, key) -> None:
        if key is None or key not in self._refs:
            return
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def _pack(self, t):
        return _Saved(t, self, self._acquire(t))

    def count(self, t) -> None:
        """A tensor held for backward outside the hooks (a checkpoint's input): it counts
        while the tensor object lives."""
        key = self._acquire(t)
        if key is not None:
            weakref.finalize(t, self._release, key)


def state_bytes(module_params, optimizer=None) -> dict:
    """Measured bytes of a rank's state, each storage once: {"params" (parameters and
    buffers), "grads" (every .grad), "optimizer" (every tensor in the optimizer's state)}."""
    def unique(tensors) -> int:
        seen = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
                s = t.untyped_storage()
                seen.setdefault(s.data_ptr(), s.nbytes())
        return sum(seen.values())
    tensors = list(module_params)
    out = {"params": unique(tensors),
           "grads": unique(t.grad for t in tensors if isinstance(t, torch.Tensor) and t.grad is not None)}
    states = []
    for opt in ([optimizer] if optimizer is not None else []):
        inner = getattr(opt, "state", None)
        inner = inner if isinstance(inner, dict) or hasattr(inner, "values") else {}
        for st in inner.values():
            states += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for attr in ("optimizer", "inner", "opt"):   # wrappers (ZeRO, loss scaling) keep one inside
            wrapped = getattr(opt, attr, None)
            if wrapped is not None and wrapped is not opt and hasattr(wrapped, "state"):
                for st in wrapped.state.values():
                    states += [v for v in st.values() if isinstance(v, torch.Tensor)]
    out["optimizer"] = unique(states)
    return out
