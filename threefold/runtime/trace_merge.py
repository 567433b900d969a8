"""Merge the ranks' recorded events into one Chrome trace-event file (Perfetto, chrome://tracing).

Clocks. Each rank timed its events with its own monotonic clock, which on different hosts
starts anywhere. Rank 0 aligns every other rank r with a few round trips (Cristian's
method): r reads its clock (t1), sends it to rank 0, rank 0 answers with its clock (t0),
r reads its clock again (t2); then r's clock runs offset = (t1 + t2) / 2 - t0 ahead of rank
0's, within half the round trip, and the round with the shortest trip is kept. The events
are shifted by their rank's offset and gathered to rank 0 (`gather_object`).

Format (the trace-event format's JSON object form): `traceEvents` holds, per rank, a
process (pid = rank) named "rank R (pp P, dp D, tp T)" with one thread per stream
(runtime/trace.STREAMS: step, compute, send, recv, collectives) and one complete event
("ph": "X", ts and dur in microseconds from the earliest event) per record, its args
naming the step, the schedule action and its position in the rank's list. `otherData`
holds the plan, the schedule, the clock offsets and the tracer's own cost.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

# One thread track per stream in the Chrome trace (tid), in the order they are drawn
# (runtime/trace.py names their indices).
STREAMS = ("step", "compute", "send", "recv", "collectives")

clock = time.perf_counter_ns     # monotonic, per process; clock_offsets aligns ranks

ROUNDS = 8            # round trips per rank; the shortest gives the offset
TAG = 24_001          # point-to-point tag of the clock exchange (apart from the engine's messages)


def clock_offsets(device) -> tuple[list[int], list[int]] | tuple[None, None]:
    """(offset ns, round trip ns) of every rank's clock against rank 0's, on rank 0; every
    rank takes part. (None, None) on the other ranks."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    if world == 1:
        return [0], [0]
    buf = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == 0:
        offsets, trips = [0], [0]
        for r in range(1, world):
            best = (0, None)
            for _ in range(ROUNDS):
                dist.recv(buf, src=r, tag=TAG)
                buf.fill_(clock())
                dist.send(buf, dst=r, tag=TAG)
                pair = torch.zeros(2, dtype=torch.int64, device=device)
                dist.recv(pair, src=r, tag=TAG)   # r's (offset, trip) of this round
                offset, trip = int(pair[0]), int(pair[1])
                if best[1] is None or trip < best[1]:
                    best = (offset, trip)
            offsets.append(best[0])
            trips.append(best[1])
        return offsets, trips
    for _ in range(ROUNDS):
        t1 = clock()
        buf.fill_(t1)
        dist.send(buf, dst=0, tag=TAG)
        dist.recv(buf, src=0, tag=TAG)
        t2 = clock()
        t0 = int(buf.item())
        pair = torch.tensor([(t1 + t2) // 2 - t0, t2 - t1], dtype=torch.int64, device=device)
        dist.send(pair, dst=0, tag=TAG)
    return None, None


def merge(own: dict, meta: dict, device) -> dict | None:
    """Collective: align clocks, gather every rank's records, and on rank 0 return the
    Chrome trace (None elsewhere)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    offsets, trips = clock_offsets(device)
    if world > 1:
        gathered = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(own, gathered, dst=0)
        if dist.get_rank() != 0:
            return None
    else:
        gathered = [own]
    return chrome_trace(gathered, offsets, trips, meta)


def chrome_trace(ranks: list[dict], offsets: list[int], trips: list[int], meta: dict) -> dict:
    """The trace-event JSON object for the gathered records (see the module docstring)."""
    base = min((e[3] - offsets[r["rank"]] for r in ranks for e in r["events"]), default=0)
    events: list[dict] = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        pid, c = r["rank"], r["coord"]
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {pid} (pp {c['pp']}, dp {c['dp']}, tp {c['tp']})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, stream in enumerate(STREAMS):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        shift = offsets[pid] + base
        for stream, name, cat, t0, t1, args in sorted(r["events"], key=lambda e: (e[3], e[0])):
            events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": stream,
                           "ts": (t0 - shift) / 1e3, "dur": max(t1 - t0, 0) / 1e3, "args": args})
    other = dict(meta)
    other["clock_sync"] = {"method": "round trips to rank 0, shortest of " + str(ROUNDS),
                           "offset_ns": list(offsets), "round_trip_ns": list(trips)}
    other["tracer"] = _overhead(ranks)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _overhead(ranks: list[dict]) -> dict:
    """What recording cost: measured ns per record times the records of a step, per rank."""
    per_rank = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        steps = max(len(r["step_ns"]), 1)
        records = len(r["events"]) / steps
        cost = records * r["event_ns"]
        wall = sum(r["step_ns"]) / steps
        per_rank.append({"rank": r["rank"], "records_per_step": records, "ns_per_record": r["event_ns"],
                         "estimated_ns_per_step": cost, "step_ns": wall,
                         "share_of_step": cost / wall if wall else 0.0})
    return {"per_rank": per_rank,
            "worst_share_of_step": max((p["share_of_step"] for p in per_rank), default=0.0)}
