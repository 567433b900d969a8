"""Sequence parallelism keeps shards for backward, not the tensors it all-gathered.

Under sequence parallelism (plan sp=true) a column-parallel linear reads the all-gather of
a sequence shard. Autograd would keep that gathered tensor (t times the shard) for the
linear's backward, and every layer's two gathers (attention's and the MLP's input) would
cost 4sbh(1 - 1/t) bytes per layer that Korthikanti et al. (arXiv 2205.05198, section 4.2.2)
do not pay: Megatron keeps the shard and all-gathers it again in backward.

We do the same for any op, not only linears, with saved-tensor hooks:
`tp_ops.all_gather_seq` registers each gathered tensor with the shard it came from, and
while a chunk's forward runs under `keep_shards()`, an op that saves a registered tensor
(or a view of it, or a detached alias, as the zero-bubble split makes) saves a reference to
the shard instead. The first backward op that unpacks it all-gathers the shard again; the
rebuilt tensor is shared by every op that saved the same gather and dropped once the last
of them has unpacked it. The numbers are the same gather of the same shard, so results are bitwise unchanged.

Every tp rank runs the same chunk code, so their backward re-gathers happen in the same
order, as the forward's did. Hooks already active outside (runtime/memory.py's counters)
see the shard where autograd would otherwise have saved the gathered tensor.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

# (device, storage pointer) of a gathered tensor -> its _Gathered; entries leave when it dies
_REGISTRY: dict[tuple, "_Gathered"] = {}


class _Gathered:
    """One all-gather: its shard and how to repeat it. Packed references share one."""
    __slots__ = ("shard", "dim", "group", "gather", "dtype", "full", "pending", "held", "rebuilt", "outer",
                 "__weakref__")

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, dim: int, group, gather):
        self.shard, self.dim, self.group, self.dtype = shard.detach(), dim, group, full.dtype
        self.gather = gather    # gather(shard, dim, group) -> full: tp_ops' all-gather
        self.full = weakref.ref(full)
        self.pending = 0        # saved references not unpacked yet
        self.held = None        # the re-gathered tensor, kept until every reference has unpacked
        self.rebuilt = None     # ... and weakly after that (a retained graph may unpack again)
        self.outer = None       # what the outer hooks packed for the shard (a counter's handle)

    def gathered(self) -> torch.Tensor:
        full = self.held
        if full is None and self.rebuilt is not None:
            full = self.rebuilt()
        if full is None:
            full = self.gather(self.shard, self.dim, self.group)
            self.rebuilt = weakref.ref(full)
        self.pending -= 1
        # q, k and v projections unpack one after another: one gather serves them all
        self.held = full if self.pending > 0 else None
        return full


class _ShardRef:
    """What autograd keeps instead of (a view of) a gathered tensor."""
    __slots__ = ("gather", "size", "stride", "offset")

    def __init__(self, gather: _Gathered, t: torch.Tensor):
        self.gather = gather
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def tensor(self) -> torch.Tensor:
        # the re-gathered tensor is laid out as the original (torch.cat: contiguous)
        return self.gather.gathered().as_strided(self.size, self.stride, self.offset)


def register(full: torch.Tensor, shard: torch.Tensor, dim: int, group, gather) -> None:
    """`full` is the all-gather of `shard` along `dim` over `group` (tp_ops.all_gather_seq),
    which `gather(shard, dim, group)` repeats in backward."""
    if full.device.type == "meta" or not torch.is_grad_enabled():
        return
    key = (full.device, full.untyped_storage().data_ptr())
    _REGISTRY[key] = _Gathered(full, shard, dim, group, gather)
    # the storage can be reused once the tensor dies; forget it then (views that outlive the
    # tensor are saved as they are: correct, only not smaller)
    weakref.finalize(full, _REGISTRY.pop, key, None)


def _lookup(t: torch.Tensor) -> _Gathered | None:
    if not _REGISTRY or t.device.type == "meta":
        return None
    g = _REGISTRY.get((t.device, t.untyped_storage().data_ptr()))
    if g is None or g.full() is None or t.dtype != g.dtype:
        return None
    return g


@contextlib.contextmanager
def keep_shards():
    """Run a chunk's forward so that gathered sequence shards are saved as shards."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)   # private in torch
    outer = top(False) if top is not None else None
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t):
        g = _lookup(t)
        if g is None:
            return ("t", outer_pack(t) if outer_pack else t)
        if outer_pack is not None and g.outer is None:
            g.outer = outer_pack(g.shard)
        g.pending += 1
        return ("s", _ShardRef(g, t))

    def unpack(packed):
        kind, value = packed
        if kind == "s":
            return value.tensor()
        return outer_unpack(value) if outer_unpack else value

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
