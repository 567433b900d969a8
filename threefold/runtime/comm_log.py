"""Record every collective and point-to-point operation a rank issues, in issue order.

`record_comm()` is a context manager that wraps torch.distributed's collective and p2p
functions (the ones the runtime calls: comm.py, zero.py's flat reduce-scatter and
all-gather, cp_ops' ring sends, random_ops' seed broadcast, checkpoint's object
collectives) so that each call appends one `CommOp` to the log before it runs. The same
wrapper is used by the dry run (runtime/dry_run.py, on torch's fake process-group backend)
and by real gloo runs, so what a dry run records is what a real run issues.

A `CommOp` names the group by its ranks and its occurrence (the k-th process group built
over exactly those ranks: ZeRO-3's all-gathers and reduce-scatters run on two groups over
the same ranks), the op, the shapes that must agree across the group, the dtype, and the
peer of a send or receive. `fake=True` (the dry run): object collectives are not sent
(their payload cannot cross a fake group) and each rank keeps its own object.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from threefold.runtime import zero


class CommOp(NamedTuple):
    op: str                   # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...
    group: tuple              # (ranks, occurrence): ranks are global, in group order
    shape: tuple              # what every member must agree on (send/recv: the tensor's shape)
    dtype: str
    peer: int = -1            # send/recv: the other rank (global); broadcast: the source
    splits: tuple = ()        # all_to_all: (output splits, input splits), rows per member
    blocking: bool = True     # False: issued with async_op=True (the rank goes on until its wait)

    def describe(self) -> str:
        if self.op in ("send", "recv"):
            return f"{self.op}{list(self.shape)} {self.dtype} {'to' if self.op == 'send' else 'from'} rank {self.peer}"
        ranks = self.group[0]
        where = f"group {list(ranks) if len(ranks) <= 8 else f'{list(ranks[:4])}..({len(ranks)} ranks)'}"
        if self.group[1]:
            where += f"#{self.group[1]}"
        splits = f" splits out {list(self.splits[0])} in {list(self.splits[1])}" if self.splits else ""
        return f"{self.op}{list(self.shape)} {self.dtype}{splits} on {where}"


class CommLog:
    """One rank's issued operations, plus the process groups it built."""

    def __init__(self, world: int, swap_at: int | None = None):
        self.world = world
        # fault injection (tests): collective number swap_at (from 0) of this rank is issued
        # after the next one, a swapped pair
        self.swap_at, self.collectives, self.held = swap_at, 0, None
        self.ops: list[CommOp] = []
        self.groups_built = 0          # dist.new_group calls (each rank builds every group)
        self.groups_joined = 0         # of those, the ones this rank is a member of
        self.joined: list[tuple] = []  # their ranks, in build order
        self._ranks: dict[int, tuple] = {}     # id(group) -> (ranks, occurrence)
        self._seen: dict[tuple, int] = {}      # ranks -> groups built over them so far

    def group_key(self, group) -> tuple:
        if group is None or group is dist.group.WORLD:
            return (tuple(range(self.world)), -1)   # the default group: not a new_group over every rank
        key = self._ranks.get(id(group))
        if key is None:   # a group not built through new_group while recording
            key = (tuple(dist.get_process_group_ranks(group)), 0)
            self._ranks[id(group)] = key
        return key

    def _built(self, group, ranks: list[int]) -> None:
        ranks = tuple(int(r) for r in ranks)
        k = self._seen.get(ranks, 0)
        self._seen[ranks] = k + 1
        self.groups_built += 1
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            self.groups_joined += 1
            self.joined.append(ranks)
            self._ranks[id(group)] = (ranks, k)


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _arg(args, kwargs, i: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


_ASYNC_AT = {"all_reduce": 3, "broadcast": 3, "all_gather": 3, "all_gather_into_tensor": 3, "all_gather_single": 3,
             "reduce_scatter_tensor": 4, "reduce_scatter_single": 4, "all_to_all_single": 5, "barrier": 1}


def _describe(name: str, log: CommLog, args, kwargs) -> CommOp | None:
    """The CommOp of one call (arguments read by name, or by the position torch's
    signature gives them)."""
    op = _describe_call(name, log, args, kwargs)
    if name in _ASYNC_AT and _arg(args, kwargs, _ASYNC_AT[name], "async_op", False):
        op = op._replace(blocking=False)
    return op


def _describe_call(name: str, log: CommLog, args, kwargs) -> CommOp | None:
    g = log.group_key(_arg(args, kwargs, {"all_reduce": 2, "broadcast": 2, "all_gather": 2,
                                          "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
                                          "all_gather_single": 2, "reduce_scatter_single": 3,
                                          "all_to_all_single": 4, "barrier": 0, "all_gather_object": 2,
                                          "broadcast_object_list": 2, "isend": 2, "irecv": 2, "send": 2,
                                          "recv": 2}[name], "group"))
    if name == "all_reduce":
        t = _arg(args, kwargs, 0, "tensor")
        return CommOp("all_reduce", g, tuple(t.shape), _dt(t))
    if name == "broadcast":
        t = _arg(args, kwargs, 0, "tensor")
        return CommOp("broadcast", g, tuple(t.shape), _dt(t), int(_arg(args, kwargs, 1, "src", 0)))
    if name == "all_gather":
        t = _arg(args, kwargs, 1, "tensor")
        return CommOp("all_gather", g, tuple(t.shape), _dt(t))
    if name in ("all_gather_into_tensor", "all_gather_single"):
        t = _arg(args, kwargs, 1, "input_tensor")
        return CommOp("all_gather", g, tuple(t.shape), _dt(t))
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        t = _arg(args, kwargs, 1, "input")
        return CommOp("reduce_scatter", g, tuple(t.shape), _dt(t))
    if name == "all_to_all_single":
        out, t = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
        n = len(g[0])
        outs = _arg(args, kwargs, 2, "output_split_sizes") or [out.shape[0] // n] * n
        ins = _arg(args, kwargs, 3, "input_split_sizes") or [t.shape[0] // n] * n
        return CommOp("all_to_all", g, tuple(t.shape[1:]), _dt(t), -1,
                      (tuple(int(x) for x in outs), tuple(int(x) for x in ins)))
    if name == "barrier":
        return CommOp("barrier", g, (), "")
    if name in ("all_gather_object", "broadcast_object_list"):
        return CommOp(name, g, (), "object")
    t = _arg(args, kwargs, 0, "tensor")
    peer = _arg(args, kwargs, 1, "dst" if name in ("isend", "send") else "src")
    op = "send" if name in ("isend", "send") else "recv"
    return CommOp(op, (), tuple(t.shape), _dt(t), int(peer))


WRAPPED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list",
           "isend", "irecv", "send", "recv") + tuple(
               n for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n))


class _Done:
    """The completed work of a call not issued yet (a held, swapped collective)."""
    def wait(self, *_):
        return True

    def is_completed(self):
        return True


def _wrap(name: str, fn, log: CommLog, fake: bool):
    def call(*args, **kwargs):
        if log.swap_at is not None and name not in ("isend", "irecv", "send", "recv"):
            log.collectives += 1
            if log.collectives == log.swap_at + 1:      # hold it: issued after the next one
                log.held = (issue, args, kwargs)
                return _Done()
            if log.held is not None:
                (held, a, k), log.held = log.held, None
                out = issue(*args, **kwargs)
                held(*a, **k)
                return out
        return issue(*args, **kwargs)

    def issue(*args, **kwargs):
        log.ops.append(_describe(name, log, args, kwargs))
        if fake and name == "all_gather_object":    # a fake group moves no bytes: keep our own
            out, obj = _arg(args, kwargs, 0, "object_gather_list"), _arg(args, kwargs, 1, "obj")
            out[:] = [obj] * len(out)
            return None
        if fake and name == "broadcast_object_list":
            return None
        return fn(*args, **kwargs)
    call.__wrapped__ = fn
    return call


@contextlib.contextmanager
def record_comm(world: int | None = None, fake: bool = False, swap_at: int | None = None):
    """Log every collective and p2p call made inside the block (yields the CommLog).
    `swap_at=k` (fault injection, tests): this rank issues its collectives k and k+1 in
    the opposite order."""
    log = CommLog(world if world is not None else dist.get_world_size(), swap_at)
    saved = {name: getattr(dist, name) for name in WRAPPED}
    saved_new_group = dist.new_group
    saved_zero = (zero._REDUCE_SCATTER_FLAT, zero._ALL_GATHER_FLAT)

    def new_group(ranks=None, *args, **kwargs):
        g = saved_new_group(ranks, *args, **kwargs)
        log._built(g, list(ranks) if ranks is not None else list(range(log.world)))
        return g
    try:
        for name, fn in saved.items():
            setattr(dist, name, _wrap(name, fn, log, fake))
        dist.new_group = new_group
        # zero.py binds its flat collectives at import: rebind them to the wrapped ones
        zero._REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        zero._ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        dist.new_group = saved_new_group
        zero._REDUCE_SCATTER_FLAT, zero._ALL_GATHER_FLAT = saved_zero
