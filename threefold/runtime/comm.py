"""Process groups from the mesh, point-to-point transfers, and failure reporting.

Groups are plain values in a `Groups` object passed to whoever needs them; nothing here is
global. Every blocking wait is bounded by the process-group timeout (THREEFOLD_TIMEOUT,
default 60 s). When a transfer fails, the error names this rank, the peer rank and what
was being moved, and adds whatever a failed rank posted on the shared store, so a dead or
failing rank makes the others fail loudly and say who.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from threefold.runtime.mesh import Mesh

FAILURE_KEY = "threefold/failure"


def default_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("THREEFOLD_TIMEOUT", "60")))


class RankFailure(RuntimeError):
    """Another rank died or failed; the message names it."""


@dataclass
class Groups:
    """This rank's process groups, built from the mesh in Megatron's rank order."""
    mesh: Mesh
    rank: int
    tp: object = None            # dist.ProcessGroup (None when the size is 1)
    dp: object = None
    pp: object = None
    ties: dict[tuple[int, ...], object] = field(default_factory=dict)  # stages -> group


def build_groups(mesh: Mesh, rank: int, tie_stage_sets: list[tuple[int, ...]] = ()) -> Groups:
    """Create every group on every rank in the same order (torch.distributed requires it)."""
    groups = Groups(mesh, rank)
    for kind, all_groups in (("tp", mesh.all_tp_groups()), ("dp", mesh.all_dp_groups()),
                             ("pp", mesh.all_pp_groups())):
        size = len(all_groups[0])
        for ranks in all_groups:
            g = dist.new_group(ranks) if size > 1 else None
            if rank in ranks:
                setattr(groups, kind, g)
    for stages in sorted(set(tie_stage_sets)):
        for d in range(mesh.dp):
            for t in range(mesh.tp):
                ranks = [mesh.rank(t, d, s) for s in stages]
                g = dist.new_group(ranks)
                if rank in ranks:
                    groups.ties[stages] = g
    return groups


def post_failure(message: str) -> None:
    """Tell the other ranks why this one is going down (best effort)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(FAILURE_KEY, message)
    except Exception:
        pass


def posted_failure() -> str | None:
    try:
        store = dist.distributed_c10d._get_default_store()
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        pass
    return None


def _fail(what: str, peer: int, exc: Exception) -> RankFailure:
    me = dist.get_rank()
    other = posted_failure()
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]  # gloo's source path
    msg = (f"rank {me}: {what} rank {peer} failed ({text[:160]}); "
           f"rank {peer} died, failed or is stuck")
    if other:
        msg += f". Reported by a failed rank: {other}"
    return RankFailure(msg)


class PendingSend:
    """Sends posted with isend: the buffers stay alive until every transfer completes."""

    def __init__(self, works: list, buffers: list[torch.Tensor], peer: int, what: str):
        self.works, self.buffers, self.peer, self.what = works, buffers, peer, what

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except Exception as exc:
            raise _fail(f"sending {self.what} to", self.peer, exc) from None
        self.buffers = []


def send(tensors: list[torch.Tensor], peer: int, what: str) -> PendingSend:
    """Post the sends without waiting (verified schedules stay deadlock-free either way;
    not blocking keeps the interleaved schedule at its simulated makespan)."""
    buffers = [t.detach().contiguous() for t in tensors]
    try:
        works = [dist.isend(b, dst=peer) for b in buffers]
    except Exception as exc:
        raise _fail(f"sending {what} to", peer, exc) from None
    return PendingSend(works, buffers, peer, what)


def recv(specs: list[tuple[tuple[int, ...], torch.dtype]], peer: int, what: str,
         device: torch.device) -> list[torch.Tensor]:
    out = []
    try:
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=peer)
            out.append(t)
    except Exception as exc:
        raise _fail(f"receiving {what} from", peer, exc) from None
    return out


def all_reduce(t: torch.Tensor, group, what: str, async_op: bool = False):
    try:
        return dist.all_reduce(t, group=group, async_op=async_op)
    except Exception as exc:
        raise _fail(f"all-reduce of {what} with", -1, exc) from None


def wait(work, what: str) -> None:
    try:
        work.wait()
    except Exception as exc:
        raise _fail(f"waiting for {what} with", -1, exc) from None
