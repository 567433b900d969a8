"""One pipeline message between two local ranks: gloo over loopback TCP against the
shared-memory channel (runtime/local_p2p.py), in one launched 2-rank job.

Rank 0 sends a message (one float32 tensor, 512 KiB by default: a microbatch activation of
the pipeline benches' h=256 GPT, 4 x 128 x 256) to rank 1, which sends it back; rounds of
`reps` round trips alternate between the two transports (the order flips every round,
a barrier before each). Reported per transport: the median over rounds of the wall time
per one-way message, and of the CPU time per message summed over both ranks (process
time: gloo's worker threads included), with their ratio channel / gloo. Receives land in
buffers kept across messages (runtime/buffer_pool.py), as in the engine.

    python bench/p2p_pingpong.py [--kib 512] [--reps 200] [--rounds 10] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def rank_job(kib: int, reps: int, rounds: int) -> dict:
    from threefold.runtime import comm, local_p2p
    from threefold.runtime.buffer_pool import BufferPool
    torch.set_num_threads(1)
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    shape = (kib * 256,)                                   # float32: kib KiB
    nbytes = local_p2p.layout([(shape, torch.float32)])[1]
    links = local_p2p.open_links({(0, 1): [nbytes] * 2, (1, 0): [nbytes] * 2})
    assert links is not None, "no shared-memory channel (THREEFOLD_LOCAL_P2P=0?)"
    payload = torch.randn(shape)
    spec = [(shape, torch.float32)]
    cpu = torch.device("cpu")
    pool = BufferPool()       # receive buffers kept, as the engine's (no page faults per message)

    def run(local) -> tuple[float, float]:
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            if me == 0:
                s = comm.send([payload], peer, "ping", local)
                got = comm.post_recv(spec, peer, "pong", cpu, pool, local).wait()[0]
            else:
                got = comm.post_recv(spec, peer, "ping", cpu, pool, local).wait()[0]
                s = comm.send([got], peer, "pong", local)
            s.wait()
        return time.perf_counter() - w0, time.process_time() - c0

    out = {"gloo": [], "shm": []}
    for r in range(rounds + 1):                            # round 0: warm-up
        order = [("gloo", None), ("shm", links)]
        for name, local in (order if r % 2 else order[::-1]):
            wall, cpu_s = run(local)
            if r:
                out[name].append((wall, cpu_s))
    links.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from threefold.runtime.launch import launch
    load0 = os.getloadavg()[0]
    r0, r1 = launch(rank_job, 2, args.kib, args.reps, args.rounds, threads=1, timeout=1800)
    msgs = 2 * args.reps
    s = {"kib": args.kib, "reps": args.reps, "rounds": args.rounds, "cores": os.cpu_count()}
    for name in ("gloo", "shm"):
        wall = [w / msgs for w, _ in r0[name]]
        cpu = [(a[1] + b[1]) / msgs for a, b in zip(r0[name], r1[name])]
        s[name] = {"wall_us": statistics.median(wall) * 1e6, "wall_us_max": max(wall) * 1e6,
                   "cpu_us": statistics.median(cpu) * 1e6}
    pairs = [a[0] / b[0] for a, b in zip(r0["shm"], r0["gloo"])]
    s["shm_vs_gloo_wall_paired"] = statistics.median(pairs)
    s["shm_vs_gloo_wall_worst"] = max(pairs)
    s["shm_vs_gloo_cpu"] = s["shm"]["cpu_us"] / s["gloo"]["cpu_us"]
    s["loadavg"] = [load0, os.getloadavg()[0]]
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"{args.kib} KiB float32 message, 2 ranks x 1 thread on {s['cores']} cores, {args.rounds} rounds of "
          f"{args.reps} round trips per transport, alternating; load {s['loadavg'][0]:.1f}/{s['loadavg'][1]:.1f}")
    for name in ("gloo", "shm"):
        x = s[name]
        print(f"  {name:<5} one-way message: wall {x['wall_us']:7.1f} us (worst round {x['wall_us_max']:7.1f}), "
              f"CPU (both ranks) {x['cpu_us']:7.1f} us")
    print(f"  shm / gloo: wall {s['shm_vs_gloo_wall_paired']:.3f} paired median (worst round "
          f"{s['shm_vs_gloo_wall_worst']:.3f}), CPU {s['shm_vs_gloo_cpu']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
