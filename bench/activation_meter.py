"""Saved-activation accounting for the pipeline benchmarks, independent of either runtime's
bookkeeping: how many forwards still have autograd-saved tensors alive, and their bytes."""
from __future__ import annotations

import torch
import torch.nn as nn


class ActivationMeter:
    """Counts forwards whose autograd-saved tensors are still alive, and their bytes.

    Each chunk/stage forward opens a record; tensors autograd saves while it runs (and,
    for torch, the loss computed right after the last stage) are charged to it. A record
    is live until every tensor saved for it has been released by backward.
    """

    def __init__(self, params):
        self.param_ptrs = {p.data_ptr() for p in params}
        self.current = None
        self.live = self.peak = 0
        self.bytes = self.peak_bytes = 0

    def wrap(self, module: nn.Module) -> None:
        inner = module.forward
        meter = self

        def forward(*args, **kwargs):
            meter.current = _Record(meter)
            return inner(*args, **kwargs)
        module.forward = forward

    def unwrap(self, module: nn.Module) -> None:
        module.__dict__.pop("forward", None)

    def pack(self, t: torch.Tensor):
        rec = self.current
        if rec is None or t.data_ptr() in self.param_ptrs:
            return t
        return _Saved(t, rec)

    @staticmethod
    def unpack(obj):
        return obj.t if isinstance(obj, _Saved) else obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Record:
    def __init__(self, meter: ActivationMeter):
        self.meter, self.refs, self.storages = meter, 0, set()

    def add(self, t: torch.Tensor) -> int:
        if self.refs == 0:
            m = self.meter
            m.live += 1
            m.peak = max(m.peak, m.live)
        self.refs += 1
        key = t.untyped_storage().data_ptr()
        if key in self.storages:
            return 0
        self.storages.add(key)
        n = t.untyped_storage().nbytes()
        self.meter.bytes += n
        self.meter.peak_bytes = max(self.meter.peak_bytes, self.meter.bytes)
        return n

    def drop(self, n: int) -> None:
        self.refs -= 1
        self.meter.bytes -= n
        if self.refs == 0:
            self.meter.live -= 1


class _Saved:
    __slots__ = ("t", "rec", "n")

    def __init__(self, t, rec):
        self.t, self.rec = t, rec
        self.n = rec.add(t)

    def __del__(self):
        self.rec.drop(self.n)


def measure_activations(step, modules, params) -> tuple[int, int]:
    meter = ActivationMeter(params)
    for m in modules:
        meter.wrap(m)
    try:
        with meter.hooks():
            step()
    finally:
        for m in modules:
            meter.unwrap(m)
    return meter.peak, meter.peak_bytes
