"""Collectives across groups: do the ranks' orders let every collective complete?

The per-group check (runtime/dry_check.py) compares each group's members' lists, one group
at a time, and so passes two ranks that are both in groups X and Y when one issues its
collective on X and then Y and the other Y and then X: each group's list agrees, yet each
rank blocks in its first collective waiting for the other, which is in the other group's.
A real job hangs there until the collective timeout.

`find_deadlock` runs the job's collectives as the backend does: a collective on a group
completes when every member has reached it (its next collective is that one, the k-th on
that group); a rank that reached it waits. Run until nothing moves: if a rank has
collectives left, the job deadlocks, and the report names two ranks that wait on each
other's group (both calls and their indices). Left out: point-to-point operations (the
runtime posts them non-blocking and waits for them with their batch; dry_check pairs them
one by one) and collectives issued with async_op=True (each group's work runs on its own,
and the rank goes on). A blocking broadcast counts as blocking: on gloo its root may finish
a small one into the socket's buffer and go on, on NCCL it waits for the group.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from threefold.runtime.dry_check import absolute_group

P2P = ("send", "recv")


@dataclass
class Deadlock:
    ranks: tuple          # (a, b): a waits on a group b is in, b on one a is in
    calls: tuple          # (a's blocked call, b's blocked call), described
    index: tuple          # their indices in each rank's collective list

    def __str__(self) -> str:
        (a, b), (ca, cb), (ia, ib) = self.ranks, self.calls, self.index
        return (f"deadlock: rank {a} waits in its collective {ia} ({ca}) for rank {b}, which waits in its "
                f"collective {ib} ({cb}) for rank {a}: the two ranks enter these groups in opposite orders")


def find_deadlock(groups: dict[int, list[tuple]], describe) -> Deadlock | None:
    """`groups[rank]`: the group (ranks, occurrence) of each of the rank's collectives in
    issue order (no p2p); `describe(rank, i)`: its i-th collective as text. None when
    every collective completes."""
    pos = dict.fromkeys(groups, 0)
    seen: dict[tuple, int] = defaultdict(int)          # (rank, group) -> collectives done on it
    arrived: dict[tuple, set] = defaultdict(set)       # (group, k) -> members waiting in it
    ready: list[tuple] = []

    def arrive(r: int) -> None:
        if pos[r] >= len(groups[r]):
            return
        g = groups[r][pos[r]]
        key = (g, seen[(r, g)])
        arrived[key].add(r)
        if len(arrived[key]) == len(g[0]):
            ready.append(key)
    for r in groups:
        arrive(r)
    while ready:
        key = ready.pop()
        for r in arrived.pop(key):
            seen[(r, key[0])] += 1
            pos[r] += 1
            arrive(r)
    stuck = sorted(r for r in groups if pos[r] < len(groups[r]))
    if not stuck:
        return None

    def waits_on(r: int) -> int:
        """A member of r's blocked collective that has not reached it."""
        g = groups[r][pos[r]]
        key = (g, seen[(r, g)])
        return min(m for m in g[0] if m not in arrived[key])
    path, r = [], stuck[0]
    while r not in path and pos.get(r, 0) < len(groups.get(r, ())):
        path.append(r)
        r = waits_on(r)
    if r not in path:     # r finished its list: the others wait on a collective it never issues
        a = path[-1]
        return Deadlock((a, r), (describe(a, pos[a]), "nothing (its list ended)"), (pos[a], pos.get(r, 0)))
    cycle = path[path.index(r):]
    a, b = cycle[0], cycle[1 % len(cycle)]
    return Deadlock((a, b), (describe(a, pos[a]), describe(b, pos[b])), (pos[a], pos[b]))


def job_groups(rel: dict[int, list[tuple]], class_of, digits) -> dict[int, list[tuple]]:
    """Every rank's collective groups in issue order, from its class's relative ops
    (runtime/dry_check.relative_ops)."""
    out = {}
    for r in range(digits.world):
        me = digits.of(r)
        cache: dict = {}
        mine = []
        for op in rel[class_of(r)]:
            if op[0] in P2P or not op[6]:   # async: the rank goes on (its wait is the batch's)
                continue
            g = cache.get(op[1])
            if g is None:
                g = cache[op[1]] = absolute_group(op[1], me, digits)
            mine.append(g)
        out[r] = mine
    return out
