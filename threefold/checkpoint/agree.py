"""One source of initial values: every rank starts from rank 0's weights (and batch).

Each rank builds the model itself, so an unseeded model gives every rank different
weights, and dp replicas (or tp shards cut from different tensors) would silently train
different models. Rank 0's values are the source of truth. A cheap fingerprint (a CRC32 of
each tensor's bytes, gathered once) shows whether the ranks already agree, which is the
common, seeded case; only tensors whose fingerprint differs from rank 0's are broadcast.
A false "differs" costs a broadcast, never a wrong result.
"""
from __future__ import annotations

import warnings
import zlib

import torch
import torch.distributed as dist

from threefold.errors import PlanError


def fingerprint(t: torch.Tensor) -> int:
    """CRC32 of the tensor's bytes (dtype and shape mixed in)."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return zlib.crc32(data, zlib.crc32(head))


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def same_as_rank0(named: dict[str, torch.Tensor], device: torch.device,
                  what: str = "weights") -> tuple[dict[str, torch.Tensor], list[str]]:
    """`named` with every tensor equal to rank 0's; also the names that differed somewhere.

    Every rank must call it with the same names in the same order (the same model code);
    a rank whose names or shapes differ from rank 0's is a PlanError naming the first.
    """
    if _world() == 1:
        return named, []
    names = list(named)
    local = [(n, tuple(named[n].shape), str(named[n].dtype), fingerprint(named[n])) for n in names]
    everyone = [None] * _world()
    dist.all_gather_object(everyone, local)
    ref = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        if [x[:3] for x in theirs] != [x[:3] for x in ref]:
            first = next((a, b) for a, b in zip(theirs + [None] * len(ref), ref + [None] * len(theirs))
                         if a is None or b is None or a[:3] != b[:3])
            raise PlanError(f"rank {r} built {what} that differ in structure from rank 0's (first: "
                            f"{_describe(first[0])} vs rank 0's {_describe(first[1])}): every rank must "
                            "build the same model")
    differ = [n for i, n in enumerate(names) if any(theirs[i][3] != ref[i][3] for theirs in everyone)]
    if not differ:
        return named, []
    out = dict(named)
    rank = dist.get_rank()
    for n in differ:
        buf = named[n].detach().to(device).contiguous()
        if rank != 0:
            buf = buf.clone()
        dist.broadcast(buf, src=0)
        out[n] = buf.to(named[n].device)
    if rank == 0:
        warnings.warn(f"threefold: ranks built different initial {what} ({len(differ)} tensors, first "
                      f"{differ[0]!r}); every rank uses rank 0's. Seed before building to silence this.",
                      stacklevel=3)
    return out, differ


def _describe(entry) -> str:
    if entry is None:
        return "nothing"
    return f"{entry[0]} {list(entry[1])} {entry[2]}"


def batch_as_rank0(batch: tuple) -> tuple:
    """The tensors of `batch` replaced by rank 0's (a factory's unseeded random batch
    would otherwise give every rank a different global batch)."""
    # lazy: start-up: runtime.assemble loads only on this path
    from threefold.runtime.assemble import default_device
    tensors = {str(i): t for i, t in enumerate(batch) if isinstance(t, torch.Tensor)}
    agreed, _ = same_as_rank0(tensors, default_device(), what="batches")
    return tuple(agreed.get(str(i), t) for i, t in enumerate(batch))
