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

import torch

_ACTIVE: list["SavedTensorCounter"] = []


class SavedTensorCounter:
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

    def __enter__(self) -> "SavedTensorCounter":
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)


def note_held(values) -> None:
    """Tensors kept for backward outside the saved-tensor hooks (a checkpoint's inputs)."""
    for counter in _ACTIVE:
        for v in values:
            counter.count(v)
