"""The few collectives checkpointing needs, each a no-op in a single process."""
from __future__ import annotations

import contextlib
import warnings

import torch.distributed as dist


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def from_rank0(value, group=None):
    """Rank 0's value on every rank (`group`: all ranks' own group, e.g. the background
    writer's, whose rank 0 is global rank 0; None: the default group)."""
    if rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_all(value, group=None) -> list:
    world = rank_world()[1]
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def quiet(world: int):
    """In a single process DCP warns that it assumes one process, which is what we mean."""
    if world > 1:
        return contextlib.nullcontext()
    ctx = warnings.catch_warnings()

    class _Quiet:
        def __enter__(self):
            ctx.__enter__()
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

        def __exit__(self, *exc):
            return ctx.__exit__(*exc)
    return _Quiet()
