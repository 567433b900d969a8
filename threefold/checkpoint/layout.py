"""Where a rank's shard sits in the full tensor: the layout a checkpoint is written in.

A tensor-parallel shard (runtime/shard.py's `ShardSpec`) is one or more contiguous pieces
of the full tensor along the split dim: one piece for a plain split, one per block for a
fused projection (q, k, v each split separately, so rank r holds q_r, k_r, v_r), and for a
padded vocabulary the rows past the real size are padding, which is never saved. Each
piece is a (local start, length, global start) triple along `dim`; DCP is told about each
piece as a chunk of the global tensor at its offsets, so any other layout can read it.
"""
from __future__ import annotations

import torch

from threefold.runtime.shard import Piece, ShardSpec, local_shape, pieces  # noqa: F401 (the layout math lives in runtime/shard.py)


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
        from threefold.placement import Replicate, Shard   # lazy: start-up: placement loads only on this path
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
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, self._offsets(p)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=self._offsets(p), sizes=self._sizes(p)),
                              properties=props, size=self.full_shape))
                for p in self.parts]

    def __create_chunk_list__(self):
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=self._offsets(p), sizes=self._sizes(p)) for p in self.parts]
