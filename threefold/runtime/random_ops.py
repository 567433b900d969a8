"""Random ops and train/eval-dependent arguments in generated code.

Every random op of the model draws from its own stream, seeded from
(base seed, step, global microbatch, the op's index in the program) and, where the op runs
on a tensor-parallel shard, the tp rank. So masks are independent across pipeline stages,
chunks, microbatches, dp ranks and shards, identical across tp ranks in replicated regions,
and a free op that two chunks both recompute draws the same mask in both, as one process
would. The compiler marks arguments with the classes below; codegen writes them as
`self.rng_seed(...)`, `self.training` and `(v if self.training else 0.0)`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class RngRef:
    """The seed of random op `index`; `per_tp_rank` for ops on tensor-parallel shards."""

    def __init__(self, index: int, per_tp_rank: bool):
        self.index, self.per_tp_rank = index, per_tp_rank

    def __repr__(self) -> str:
        return f"RngRef({self.index}, {self.per_tp_rank})"


class TrainFlag:
    """True in train mode, False in eval mode (the ChunkModule's `training`)."""

    def __repr__(self) -> str:
        return "TrainFlag()"


class TrainValue:
    """`value` in train mode, `eval_value` in eval mode (SDPA's dropout_p)."""

    def __init__(self, value, eval_value):
        self.value, self.eval_value = value, eval_value

    def __repr__(self) -> str:
        return f"TrainValue({self.value!r}, {self.eval_value!r})"


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (the same in every process: ints hash deterministically)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


def dropout(x: torch.Tensor, p: float, train: bool, seed: int) -> torch.Tensor:
    """aten.dropout with a mask from this op's own generator."""
    if not train or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    gen = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


def seeded(seed: int, fn, *args, **kwargs):
    """Any other random op (bernoulli, rand_like, SDPA's dropout...) with the global
    generator set to this op's seed for the call, and restored after."""
    devices = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            devices = [a.device.index or 0]
            break
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)


def shared_seed() -> int:
    """The base seed of random ops: rank 0's torch.initial_seed(), the same on every rank."""
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            seed = seed.cuda()
        dist.broadcast(seed, src=0)
    return int(seed.item())
