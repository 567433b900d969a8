"""Store round trips a rank makes that a dry run's fake backend never makes: the backend's
own rendezvous of each process group it joins.

torch's fake process-group backend completes every collective at once and never touches
the store, but a real backend connects each group's members through it when the group is
built. What the backends do, per group of n ranks that this rank joins (measured on torch
2.13 with a counting store around the job's TCPStore; tests/test_dry_run_store.py checks
the gloo rule against a real 4-rank gloo job):

  gloo  every member sets its address under the group's prefix, then waits for and reads
        every member's (its own included): 1 set + n waits + n gets. A group the rank does
        not join costs it nothing (new_group returns without a backend there).
  nccl  the group's first member sets the communicator's unique id, every other member
        waits for it and reads it: 1 set, or 1 wait + 1 get (NCCL builds a communicator
        at the group's first collective: counted for every joined group, an upper bound
        where a group is never used).

The store calls threefold itself makes (rank 0's compile handshake in parallelize, a
failure posted by a dying rank) run as they are in the dry run too: its counting store
records them (runtime/dry_run.CountingStore).
"""
from __future__ import annotations

BACKENDS = ("gloo", "nccl")


def backend_store_ops(joined: list[tuple[int, ...]], rank: int, backend: str = "gloo") -> dict[str, int]:
    """{kind: calls} the backend's rendezvous makes on `rank` for the groups it joined
    (each as its ranks, the default group included)."""
    if backend not in BACKENDS:
        raise ValueError(f"no store rule for backend {backend!r}: one of {', '.join(BACKENDS)}")
    out = {"set": 0, "wait": 0, "get": 0}
    for ranks in joined:
        n = len(ranks)
        if backend == "gloo":
            out["set"] += 1
            out["wait"] += n
            out["get"] += n
        elif ranks and ranks[0] == rank:
            out["set"] += 1
        else:
            out["wait"] += 1
            out["get"] += 1
    return {k: v for k, v in out.items() if v}


def add_ops(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}
