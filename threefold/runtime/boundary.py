"""What crosses a pipeline boundary, and in what form.

With tensor parallelism every tp rank of a stage holds the same replicated boundary
tensors. Sending all of them from every tp rank would move each byte t times; instead
(paper, section 4.1) each tp rank sends 1/t of the flattened tensor to its peer and the
receiving tp ranks all-gather the pieces. The same holds for the gradients going back.
Sequence-parallel boundaries are already split per rank and are sent as they are.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.placement import is_replicated, parse
from threefold.runtime import comm   # bounded, and a failure names the group

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


def is_scattered(placement, numel: int, t: int, scatter_gather: bool) -> bool:
    """The scatter/gather rule: a plainly replicated boundary tensor (R: not R(f), R*, P
    or S) whose elements divide by t is sent as 1/t per tp rank and all-gathered by the
    receivers; anything else goes whole. `placement`: typed, or the manifest's text."""
    return bool(scatter_gather) and t > 1 and is_replicated(parse(placement)) and numel % t == 0


def sent_elements(placement, numel: int, t: int, scatter_gather: bool) -> int:
    """Elements one tp rank sends for a boundary tensor of `numel` elements."""
    return numel // t if is_scattered(placement, numel, t, scatter_gather) else numel


class Boundary:
    """The tensors of one chunk boundary (a chunk's inputs or outputs): the manifest's
    `TensorSpec`s of one side of a chunk."""

    def __init__(self, entries, tp_group, scatter_gather: bool, grads: bool = False,
                 wire: torch.dtype | None = None):
        if grads:
            entries = [e for e in entries if _DTYPES[e.dtype].is_floating_point]
        self.entries = entries
        self.group = tp_group
        self.t = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.r = dist.get_rank(tp_group) if tp_group is not None else 0
        self.split = [is_scattered(e.placement, e.numel, self.t, scatter_gather) for e in entries]
        # plan dtype=bf16/fp16: floating tensors travel in the compute dtype (half the bytes)
        # and are cast back to their declared dtype on arrival (runtime/mixed_precision.py)
        self.wire = [(wire or _DTYPES[e.dtype]) if _DTYPES[e.dtype].is_floating_point else None
                     for e in entries]
        # the same every message: one hashable tuple (runtime/local_p2p keys its layouts by it)
        self._specs = tuple(((e.numel // self.t,) if s else tuple(e.shape), w or _DTYPES[e.dtype])
                            for e, s, w in zip(self.entries, self.split, self.wire))
        self._whole = not any(self.split)

    def pack(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank sends: its 1/t piece of each split tensor, others whole."""
        out = tensors if self._whole else [t.reshape(-1).chunk(self.t)[self.r] if s else t
                                           for t, s in zip(tensors, self.split)]
        # (t.to(w) is t itself where the dtype is already w: skip the call, ~1 us per tensor)
        return [t if w is None or t.dtype is w else t.to(w) for t, w in zip(out, self.wire)]

    def recv_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        return self._specs

    def unpack(self, received: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t, e, s, w in zip(received, self.entries, self.split, self.wire):
            if s:
                pieces = [torch.empty_like(t) for _ in range(self.t)]
                comm.all_gather(pieces, t, self.group, "the pieces of a scatter/gather boundary tensor")
                t = torch.cat(pieces).view(e.shape)
            if w is not None and t.dtype != _DTYPES[e.dtype]:
                t = t.to(_DTYPES[e.dtype])
            out.append(t)
        return out

    @property
    def saved_fraction(self) -> float:
        """Share of point-to-point bytes scatter/gather saves (for inspect and benches)."""
        total = sum(e.numel for e in self.entries) or 1
        saved = sum(e.numel * (1 - 1 / self.t) for e, s in zip(self.entries, self.split) if s)
        return saved / total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
