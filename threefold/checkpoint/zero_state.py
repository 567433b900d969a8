"""Optimizer state under ZeRO (runtime/zero.py), and zero=3's parameters, as pieces of the
full tensor.

A ZeRO-1 rank holds optimizer state for rows [start, start + count) of its local
parameter (its tp shard). Those rows are a rectangle of the full tensor: along dim 0 they
narrow the tp pieces when tp splits dim 0, and they add a dim-0 range to them when tp
splits another dim. So the state is written under the same keys and in the same full
shape as zero=0's (`optim.<fqn>.<name>`), each rank writing only its rows, and DCP's
overlap reads let any plan (zero=0 or 1, any tp/pp/dp) load any other's checkpoint.
"""
from __future__ import annotations

import torch

from threefold.checkpoint.layout import Sharded


class RowsOf(Sharded):
    """Rows [start, start + count) of a parameter whose local layout is `param`, held in
    `local` (shaped like those rows; a 0-d parameter's state is shaped [count])."""

    def __init__(self, param: Sharded, start: int, count: int, local: torch.Tensor):
        self.local = local
        self.full_shape = param.full_shape
        self.dim = param.dim
        self.parts = []
        self._chunks: list[tuple[torch.Size, torch.Size, torch.Tensor]] = []   # offsets, sizes, view
        nd = len(self.full_shape)
        if nd == 0:
            if count:
                self._chunks.append((torch.Size([]), torch.Size([]), local.reshape(())))
            return
        for p in param.parts:
            offs, sizes = [0] * nd, list(self.full_shape)
            if param.dim == 0:     # tp split rows too: intersect the two row ranges
                lo, hi = max(p.local, start), min(p.local + p.length, start + count)
                if hi <= lo:
                    continue
                offs[0], sizes[0] = p.start + lo - p.local, hi - lo
                view = local.narrow(0, lo - start, hi - lo)
            else:                  # dim 0 is whole in the shard: local rows are global rows
                if not count:
                    continue
                offs[0], sizes[0] = start, count
                offs[param.dim], sizes[param.dim] = p.start, p.length
                view = local.narrow(param.dim, p.local, p.length)
            self._chunks.append((torch.Size(offs), torch.Size(sizes), view))

    def regions(self) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
        return list(self._chunks)

    def piece_at(self, offsets) -> torch.Tensor:
        for offs, _, view in self._chunks:
            if offs == torch.Size(offsets):
                return view
        raise KeyError(f"no piece at offsets {list(offsets)}")

    def zero_padding(self) -> None:
        pass   # a fresh zero tensor: rows no piece covers (vocabulary padding) stay zero

    def __create_write_items__(self, fqn: str, obj):
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, offs), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offs, sizes=sizes),
                                                      properties=props, size=self.full_shape))
                for offs, sizes, _ in self._chunks]

    def __create_chunk_list__(self):
        # lazy: DCP loads only when a checkpoint is saved or loaded
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=offs, sizes=sizes) for offs, sizes, _ in self._chunks]


def rows_within(layout: Sharded, start: int, count: int, local: torch.Tensor) -> RowsOf:
    """Rows [start, start + count) of `layout`'s local tensor, as pieces of the full tensor.
    An ep expert layout is itself a row range of the full tensor (`rows_base`: the tp layout
    and the first global row), so ZeRO's rows of it are rows of that range: one RowsOf of
    the tp layout, offset by the ep rows' start."""
    base = getattr(layout, "rows_base", None)
    if base is not None:
        tp_layout, first = base
        return RowsOf(tp_layout, first + start, count, local)
    return RowsOf(layout, start, count, local)


def shape_only(p: torch.Tensor) -> torch.Tensor:
    """A stand-in for a parameter whose layout is wanted but whose data is not read (zero=3
    frees parameters between uses; only the layout's pieces and shape are used)."""
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def row_shards(optimizer):
    """The ZeRO-1 optimizer's RowShards by FQN (through wrappers such as fp16's), or None."""
    seen = 0
    while optimizer is not None and seen < 4:
        if hasattr(optimizer, "row_shards"):
            return optimizer.row_shards()
        optimizer = getattr(optimizer, "inner", None)
        seen += 1
    return None


def optimizer_params(pm, optimizer, layout_of):
    """(fqn, the tensor the optimizer keys its state by, layout(state tensor) -> Sharded)
    for each trainable parameter: the parameter itself (zero=0) or its row shard (zero>=1;
    under ep an expert's row shard is rows of its ep rows: `rows_within`)."""
    shards = row_shards(optimizer)
    if shards is None:
        for fqn, p in pm.engine.params.items():
            yield fqn, p, (lambda t, fqn=fqn: layout_of(pm, fqn, t))
        return
    for fqn, s in shards.items():
        def layout(t, fqn=fqn, s=s):
            return rows_within(layout_of(pm, fqn, shape_only(s.param)), s.start, s.count, t)
        yield fqn, s.shard, layout
