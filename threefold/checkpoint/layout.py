"""Where a rank's shard sits in the full tensor: the layout a checkpoint is written in.

A tensor-parallel shard (runtime/shard.py's `ShardSpec`) is one or more contiguous pieces
of the full tensor along the split dim: one piece for a plain split, one per block for a
fused projection (q, k, v each split separately, so rank r holds q_r, k_r, v_r), and for a
padded vocabulary the rows past the real size are padding, which is never saved. Each
piece is a (local start, length, global start) triple along `dim`; DCP is told about each
piece as a chunk of the global tensor at its offsets, so any other layout can read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.runtime.shard import ShardSpec


@dataclass(frozen=True)
class Piece:
    local: int     # start along dim in this rank's tensor
    length: int
    start: int     # start along dim in the full tensor


def _chunk(size: int, t: int, r: int) -> tuple[int, int]:
    """torch.chunk's r-th piece of `size` in t parts: (start, length)."""
    c = -(-size // t)
    start = min(r * c, size)
    return start, max(0, min(size, start + c) - start)


def pieces(spec: ShardSpec | None, full_shape, tp_rank: int, owned: bool = False) -> tuple[int, list[Piece]]:
    """(dim, pieces) of tp rank `tp_rank`'s shard of a tensor of `full_shape`. A block every
    rank holds whole is a piece of each (loads fill it everywhere, DCP writes it once); with
    `owned`, of tp rank 0 only (what a sum over ranks must count once)."""
    full_shape = list(full_shape)
    if spec is None:
        return 0, [Piece(0, full_shape[0] if full_shape else 1, 0)]
    dim, t = spec.dim, spec.t
    out: list[Piece] = []
    if spec.blocks:
        local, offset = 0, 0
        for b, whole in zip(spec.blocks, spec.whole or (False,) * len(spec.blocks)):
            start, n = (0, b) if whole else _chunk(b, t, tp_rank)
            if not (whole and owned and tp_rank):
                out.append(Piece(local, n, offset + start))
            local, offset = local + n, offset + b
        return dim, [p for p in out if p.length]
    start, n = _chunk(spec.padded, t, tp_rank)
    real = max(0, min(full_shape[dim], start + n) - start)   # rows past the real size: padding
    return dim, [Piece(0, real, start)] if real else []


def local_shape(spec: ShardSpec | None, full_shape, tp_rank: int) -> list[int]:
    shape = list(full_shape)
    if spec is not None:
        whole = spec.whole or (False,) * len(spec.blocks)
        shape[spec.dim] = (sum(b if w else _chunk(b, spec.t, tp_rank)[1] for b, w in zip(spec.blocks, whole))
                           if spec.blocks
                           else _chunk(spec.padded, spec.t, tp_rank)[1])
    return shape


class Sharded:
    """A value of `pm.state_dict()` (threefold.Sharded): one rank's share of a full tensor.

      .shape, .size(), .ndim   the FULL tensor's shape (as the single-process state_dict's)
      .dtype, .device          the shard's
      .local                   this rank's tensor (the parameter itself: writes go into it)
      .placement               over the tensor-parallel ranks: Replicate() (every tp rank
                               holds all of it) or Shard(dim, blocks) (threefold/placement.py)
      .parts, .dim             where .local sits in the full tensor: pieces (local start,
                               length, full start) along dim .dim (several for a fused
                               q/k/v projection; padding rows of a padded vocabulary in none)
      .spec                    the manifest's ShardSpec (None when whole)

    Replicas of it live on every dp rank (and, for a tied parameter, on every stage that
    uses it). It is also DCP's checkpointable protocol (`__create_write_items__`,
    `__create_chunk_list__`, and `piece_at` for our planners)."""

    spec = None     # ShardSpec, set by checkpoint/state.layout_of

    def __init__(self, local: torch.Tensor, dim: int, parts: list[Piece], full_shape):
        self.local = local
        self.dim = dim
        self.parts = parts
        self.full_shape = torch.Size(full_shape)

    def size(self, dim: int | None = None):   # DCP compares this with the saved size
        return self.full_shape if dim is None else self.full_shape[dim]

    @property
    def shape(self) -> torch.Size:
        return self.full_shape

    @property
    def ndim(self) -> int:
        return len(self.full_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def placement(self):
        from threefold.placement import Replicate, Shard
        return Shard(self.spec.dim, tuple(self.spec.blocks)) if self.spec is not None else Replicate()

    def __repr__(self) -> str:
        return (f"Sharded(shape={list(self.full_shape)}, placement={self.placement}, "
                f"local={list(self.local.shape)}, dtype={self.dtype})")

    def _offsets(self, p: Piece) -> torch.Size:
        offs = [0] * len(self.full_shape)
        if offs:
            offs[self.dim] = p.start
        return torch.Size(offs)

    def _sizes(self, p: Piece) -> torch.Size:
        sizes = list(self.full_shape)
        if sizes:
            sizes[self.dim] = p.length
        return torch.Size(sizes)

    def view(self, p: Piece) -> torch.Tensor:
        return self.local.narrow(self.dim, p.local, p.length) if self.local.dim() else self.local

    def piece_at(self, offsets) -> torch.Tensor:
        for p in self.parts:
            if self._offsets(p) == torch.Size(offsets):
                return self.view(p)
        raise KeyError(f"no piece at offsets {list(offsets)}")

    def regions(self) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
        """(offsets, sizes, view) of every piece of the full tensor this rank holds."""
        return [(self._offsets(p), self._sizes(p), self.view(p)) for p in self.parts]

    def zero_padding(self) -> None:
        """Zero what no piece covers (padded vocabulary rows), before loading into it."""
        covered = sum(p.length for p in self.parts)
        if self.local.dim() and covered < self.local.shape[self.dim]:
            with torch.no_grad():
                self.local.narrow(self.dim, covered, self.local.shape[self.dim] - covered).zero_()

    # -- DCP's protocol ----------------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, self._offsets(p)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=self._offsets(p), sizes=self._sizes(p)),
                              properties=props, size=self.full_shape))
                for p in self.parts]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=self._offsets(p), sizes=self._sizes(p)) for p in self.parts]
