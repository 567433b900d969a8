"""When a rank posts its receives, and when it waits for them.

gloo's point-to-point transfers are a rendezvous: a send whose receive is not posted yet
only announces itself, and its bytes leave when the receiver posts the receive and tells
the sender so, a round trip through both ranks' transport threads on the critical path.
A receive posted before its sender gets to the send lets the bytes leave at once and land
while the receiver is still computing (NCCL and torch.distributed.pipelining batch their
receives with the sends for the same reason).

So the engine posts each receive (irecv) `lookahead` computes before the compute that
reads it, or at its own place in the action list if that is earlier, and waits for it just
before that compute. Receives from one peer are posted in list order, so the messages
between two ranks are matched in the order `simulate.verify` checked; posting earlier and
waiting later never delays a send, so a list that cannot deadlock with blocking receives
cannot deadlock this way either. Memory: at most the receives of `lookahead` computes are
held before their compute runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from threefold.runtime.schedule import Action, Kind

# Computes ahead of its reader a receive is posted. Measured (BENCHMARKS.md, pipeline
# runtime): 2 -> 8 cuts CPU and wall per step further; beyond 8 little changes, while every
# posted receive holds one boundary tensor (a small part of one microbatch's activations).
LOOKAHEAD = 8

_READER = {Kind.RECV_ACT: Kind.FORWARD, Kind.RECV_GRAD: Kind.BACKWARD}


@dataclass(frozen=True)
class ReceivePlan:
    """For one rank's action list: positions -> the receive positions to post just before
    running it, and the receive positions whose tensors must have landed before it runs.
    Position len(actions) means after the last action."""
    post_before: dict[int, tuple[int, ...]]
    land_before: dict[int, tuple[int, ...]]


def receive_plan(actions: list[Action], lookahead: int = LOOKAHEAD) -> ReceivePlan:
    computes = [i for i, a in enumerate(actions) if a.is_compute]
    order = {i: n for n, i in enumerate(computes)}            # position -> index among computes
    where = {(a.kind, a.chunk, a.mb): i for i, a in enumerate(actions) if a.is_compute}
    post: dict[int, int] = {}
    land: dict[int, list[int]] = {}
    for j, a in enumerate(actions):
        if not a.is_recv:
            continue
        reader = where.get((_READER[a.kind], a.chunk, a.mb), len(actions))
        land.setdefault(reader, []).append(j)
        early = computes[max(order[reader] - lookahead, 0)] if reader in order and lookahead > 0 else j
        post[j] = min(j, early)
    # From one peer, a later receive posted early pulls the earlier ones with it (list order).
    latest: dict[int, int] = {}
    for j in sorted(post, reverse=True):
        peer = actions[j].peer
        if peer in latest:
            post[j] = min(post[j], latest[peer])
        latest[peer] = post[j]
    post_before: dict[int, list[int]] = {}
    for j in sorted(post):
        post_before.setdefault(post[j], []).append(j)
    return ReceivePlan({p: tuple(js) for p, js in post_before.items()},
                       {p: tuple(js) for p, js in land.items()})


def blocking_plan(actions: list[Action]) -> ReceivePlan:
    """Each receive posted and waited for at its own place in the list: a blocking receive,
    as the engine ran before issue 13 (bench/pipeline_vs_torch.py --ablations compares)."""
    recvs = {j: (j,) for j, a in enumerate(actions) if a.is_recv}
    return ReceivePlan(dict(recvs), dict(recvs))
