"""DCP planners that read and write `Sharded` values (layout.py) piece by piece.

DCP's default planners already build write items and read items from the
`__create_write_items__` / `__create_chunk_list__` protocol; what they cannot do for a value
that is not a tensor is find the tensor of one piece, which these two lookups add. Replicated
values (the same piece saved by several ranks: dp replicas, tp-replicated parameters, tied
parameters on several stages) carry the same index, so DCP's dedup writes each once.
"""
from __future__ import annotations

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from threefold.checkpoint.layout import Sharded
from threefold.checkpoint.safe_read import safe_load_bytes


class SaveShards(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Sharded):
            return obj.piece_at(index.offset).detach().contiguous()
        return super().lookup_object(index)


class LoadShards(DefaultLoadPlanner):
    """Reads each saved chunk's overlap with each of this rank's pieces straight into a
    view of the destination (a parameter or an optimizer moment): no full tensor is built."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # The default set-up walks the values to materialise meta tensors and replaces any
        # type it does not know (ours) with None; our values are never on meta, so skip it.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Sharded):
            return obj.piece_at(index.offset)
        return super().lookup_tensor(index)

    load_bytes = safe_load_bytes     # non-tensor values: weights_only (checkpoint/safe_read.py)
