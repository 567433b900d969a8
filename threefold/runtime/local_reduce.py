"""The data-parallel gradient sum through shared memory, for batch ranks on one host (CPU).

Why: on CPU a gloo all-reduce of the gradient bucket hands the tensor to a worker thread,
which ring-reduces it over loopback TCP through a device thread: kernel copies and thread
hand-offs that compete with the ranks' compute for the same cores (embedded GPT, 880 KB on
2 ranks: ~0.85-1.9 ms of process CPU and 2.9 ms wall per step under load, against 0.4-0.8
and 0.55 ms here). Ranks on one host can read each other's memory instead:

  * every rank writes its flat bucket into its own slot of a shared segment (a file in
    /dev/shm, mapped by every rank and unlinked once all have it: nothing is left behind
    when a job dies);
  * one small gloo all-reduce is the barrier, and it carries the step's loss share
    (float64), so a data-parallel step has one collective, not two;
  * every rank then sums the slots itself, in rank order: the same bits on every rank (two
    ranks: a + b, what gloo computes).

Two buffers alternate, so the next exchange never overwrites what a slower peer still
reads: a rank writes buffer k % 2 at exchange k only after exchange k-1's barrier, which
its peers enter only after they summed buffer (k-2) % 2 = k % 2.

Memory: 2 x (group size) x the buckets' elements, shared by the group's ranks (twice a
rank's gradients at two ranks), reserved when the segment is made.

Set-up is collective and agreed: rank 0 names the segment, each group's first rank creates
it, every rank maps it if it exists, each writes a mark into its slot, and all keep the shared
path only if every rank sees every mark (ranks on other hosts, no /dev/shm,
THREEFOLD_LOCAL_REDUCE=0 anywhere: gloo for everyone).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from threefold.runtime import comm, shm
from threefold.runtime.mesh import BATCH_AXES

SHM_DIR = "/dev/shm"
ENV = "THREEFOLD_LOCAL_REDUCE"   # "0": always gloo (what the bench compares against)


class LocalExchange:
    """One process group's shared segment: [2 buffers][group size slots][numel] of `dtype`."""

    def __init__(self, segment: torch.Tensor, index: int, group, offsets: dict):
        self.segment = segment      # (2, n, numel)
        self.index = index          # this rank's slot
        self.group = group
        self.offsets = offsets      # bucket key -> (offset, numel)
        self.count = 0              # exchanges done (every rank the same)
        self._out: dict = {}        # bucket key -> persistent sum buffer

    def slot(self, key) -> torch.Tensor:
        """Where this rank writes bucket `key` for the coming exchange."""
        off, n = self.offsets[key]
        return self.segment[self.count % 2, self.index, off:off + n]

    def barrier(self, carried: torch.Tensor, what: str) -> None:
        """Every rank's slots are written: the one collective of the exchange (in place on
        `carried`, summed over the group: the loss share, or a zero)."""
        comm.all_reduce(carried, self.group, what)
        self.count += 1

    def summed(self, key) -> torch.Tensor:
        """Bucket `key` summed over the group's slots, in rank order (after the barrier)."""
        off, n = self.offsets[key]
        slots = self.segment[(self.count - 1) % 2, :, off:off + n]
        out = self._out.get(key)
        if out is None:
            out = self._out[key] = torch.empty(n, dtype=self.segment.dtype)
        if slots.shape[0] == 2:
            torch.add(slots[0], slots[1], out=out)
        else:
            out.copy_(slots[0])
            for i in range(1, slots.shape[0]):
                out.add_(slots[i])
        return out


def batch_buckets(buckets, params: dict) -> tuple[dict, torch.dtype]:
    """({(chunk, index): numel} of the buckets summed over the batch axes, their common
    dtype) from a stage's gradient buckets (runtime/collective_plan)."""
    sizes, dtype = {}, None
    for b in buckets:
        if b.axes == BATCH_AXES:
            ps = [params[f] for f in b.fqns]
            sizes[(b.chunk, b.index)] = sum(p.numel() for p in ps)
            for p in ps:
                dtype = p.dtype if dtype is None else torch.promote_types(dtype, p.dtype)
    return sizes, dtype or torch.float32


def open_exchange(group, buckets: dict, dtype: torch.dtype) -> LocalExchange | None:
    """Collective over every rank (each calls it at the same point): the shared segment for
    `group`'s buckets (key -> numel), or None where any rank cannot share memory with its
    group (then every rank uses gloo). Set-up steps: runtime/shm.py."""
    token = shm.job_token()
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else []
    offsets, total = {}, 0
    for key, n in buckets.items():
        offsets[key] = (total, n)
        total += n
    ok = os.environ.get(ENV, "1") != "0" and bool(ranks) and total > 0 and os.path.isdir(SHM_DIR)
    path = os.path.join(SHM_DIR, f"threefold-{token}-{ranks[0] if ranks else 0}")
    count = 2 * len(ranks) * total
    creator = ok and dist.get_rank() == ranks[0]
    if creator:
        ok = shm.create(path, count * torch.empty((), dtype=dtype).element_size())
    try:
        ok = shm.agree(ok)
        segment = shm.map_existing(path, count, dtype) if ok else None
        ok = shm.agree(segment is not None)
        if ok:   # proof the ranks share the pages: each rank's mark is seen by every rank
            segment = segment.view(2, len(ranks), total)
            index = ranks.index(dist.get_rank())
            segment[0, index, 0] = index + 1
            ok = shm.agree(True)
            ok = ok and shm.agree(bool((segment[0, :, 0] == torch.arange(1, len(ranks) + 1, dtype=dtype)).all()))
    finally:
        if creator:
            shm.unlink(path)    # every rank has it mapped, gave up or failed: the name is not needed
    if not ok:
        return None
    return LocalExchange(segment, ranks.index(dist.get_rank()), group, offsets)
