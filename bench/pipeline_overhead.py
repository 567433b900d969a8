"""What threefold's pipeline runtime costs besides compute, per rank and step (issue 25).

Wall time on this shared 2-core machine moves with other jobs' load by more than the
runtime's whole overhead, so this counts CPU time, which barely does. For each schedule,
after warm-up steps, instrumented steps are run on every rank and report (per step):

  * main: the rank's main-thread CPU time (time.thread_time) for the whole step;
  * compute: the part of it inside F, B and W actions (the generated chunks and autograd);
  * outside: main - compute: the runtime's own work on the step's thread (dispatch,
    posting and landing receives, sends, bookkeeping, the step's collectives);
  * send: the CPU of the send calls within it (with receives posted ahead, gloo writes the
    bytes into the socket from this thread);
  * process: the process's CPU (adds gloo's transport threads);
  * F / B / W: compute by action kind; preempt: involuntary context switches inside
    compute (another process took the core mid-action); faults: minor page faults in it;
  * wait: wall time waiting for receives, and hop: the part of those waits that came after
    the matching send was posted (what one message costs on the critical path).

    python bench/pipeline_overhead.py [--pp 2] [--m 8] [--n-embd 256] [--steps 3] [--schedules 1f1b,interleaved,zbv]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from pipeline_vs_torch import build_workload  # noqa: E402

V = {"1f1b": 1, "interleaved": 2, "zb-h1": 1, "zbv": 2}


@dataclass(frozen=True)
class Config:
    pp: int = 2
    m: int = 8
    n_layer: int = 8
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 256
    seq: int = 128
    batch: int = 16
    warmup: int = 2
    steps: int = 3
    schedules: tuple = ("1f1b", "interleaved", "zbv")


def plan(cfg: Config, kind: str) -> str:
    v = V[kind]
    k = cfg.pp * v
    split = "+".join(f"h.{cfg.n_layer // k * i}" for i in range(1, k))
    return f"pp={cfg.pp},m={cfg.m},schedule={kind}" + (f",v={v}" if v > 1 else "") + f",split={split}"


def instrumented_step(pm, step) -> dict:
    """One step with F/B/W, sends and receive waits timed; wall clocks are perf_counter
    (system-wide monotonic on Linux, so ranks on one host compare)."""
    from threefold.runtime import comm
    from threefold.runtime.local_p2p import ChannelRecv
    eng = pm.engine
    out = {"compute": 0.0, "send": 0.0, "sends": {}, "waits": [], "F": 0.0, "B": 0.0, "W": 0.0,
           "preempted": 0, "faults": 0}

    def timed(fn):
        def run(st, a):
            # (involuntary context switches inside compute: another process took the core
            # mid-action, and the action's cache lines with it)
            r0, c = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
            fn(st, a)
            dt, r1 = time.thread_time() - c, resource.getrusage(resource.RUSAGE_THREAD)
            out["compute"] += dt
            out[a.kind.value] += dt
            out["preempted"] += r1.ru_nivcsw - r0.ru_nivcsw
            out["faults"] += r1.ru_minflt - r0.ru_minflt
        return run

    send, wait, channel_wait = comm.send, comm.PendingRecv.wait, ChannelRecv.wait

    def timed_send(tensors, peer, what, *rest):
        out["sends"][what] = time.perf_counter()
        c = time.thread_time()
        try:
            return send(tensors, peer, what, *rest)
        finally:
            out["send"] += time.thread_time() - c

    def timing(wait):
        def timed_wait(self):
            t = time.perf_counter()
            try:
                return wait(self)
            finally:
                out["waits"].append((self.what, t, time.perf_counter()))
        return timed_wait

    for attr in ("_forward", "_backward_action", "_weight_action"):
        setattr(eng, attr, timed(getattr(eng, attr)))
    # (receives through shared memory, runtime/local_p2p.py, wait in ChannelRecv.wait)
    comm.send, comm.PendingRecv.wait, ChannelRecv.wait = timed_send, timing(wait), timing(channel_wait)
    try:
        dist.barrier()
        c, p = time.thread_time(), time.process_time()
        step()
        out["main"], out["process"] = time.thread_time() - c, time.process_time() - p
    finally:
        comm.send, comm.PendingRecv.wait, ChannelRecv.wait = send, wait, channel_wait
        for attr in ("_forward", "_backward_action", "_weight_action"):
            del eng.__dict__[attr]
    return out


def rank_job(cfg: Config) -> dict:
    import threefold
    torch.set_num_threads(1)
    res = {}
    for kind in cfg.schedules:
        w = build_workload(cfg)
        pm = threefold.parallelize(w["model"], plan(cfg, kind), w["inputs"], w["loss_fn"], target=w["target"])

        def step(pm=pm, w=w):
            pm.zero_grad()
            return pm.step(*w["inputs"], target=w["target"])
        for _ in range(cfg.warmup):
            dist.barrier()
            step()
        res[kind] = [instrumented_step(pm, step) for _ in range(cfg.steps)]
        dist.barrier()
    return res


def summarize(cfg: Config, ranks: list[dict]) -> dict:
    rows = {}
    for kind in cfg.schedules:
        per_rank = []
        for r, res in enumerate(ranks):
            steps = res[kind]
            hops, waits = [], []
            for i, s in enumerate(steps):
                sent = {}
                for other in ranks:   # the matching send, posted by the peer in the same step
                    sent.update(other[kind][i]["sends"])
                for what, t0, t1 in s["waits"]:
                    waits.append(t1 - t0)
                    if what in sent and t1 > sent[what] and sent[what] > t0:
                        hops.append(t1 - sent[what])
                    elif what in sent and t1 > t0 and sent[what] <= t0:
                        hops.append(t1 - t0)

            def med(key):
                return statistics.median(s[key] for s in steps) * 1e3
            per_rank.append({"main_ms": med("main"), "compute_ms": med("compute"),
                             "outside_ms": statistics.median(s["main"] - s["compute"] for s in steps) * 1e3,
                             "send_ms": med("send"), "process_ms": med("process"),
                             "wait_ms": sum(waits) / len(steps) * 1e3,
                             "hop_median_ms": statistics.median(hops) * 1e3 if hops else 0.0,
                             "messages": len(waits) // len(steps),
                             **{k + "_ms": med(k) for k in "FBW"},
                             "preempted": statistics.median(s["preempted"] for s in steps),
                             "faults": statistics.median(s["faults"] for s in steps)})
        rows[kind] = per_rank
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in ("pp", "m", "n_layer", "n_embd", "vocab_size", "seq", "batch", "warmup", "steps"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, dest=f)
    ap.add_argument("--schedules", type=lambda s: tuple(s.split(",")))
    args = ap.parse_args(argv)
    cfg = Config(**{k: v for k, v in vars(args).items() if v is not None})
    from threefold.runtime.launch import launch
    load0 = os.getloadavg()[0]
    ranks = launch(rank_job, cfg.pp, cfg, threads=1, timeout=1800)
    rows = summarize(cfg, ranks)
    print(f"GPT {cfg.n_layer} x {cfg.n_embd}, seq {cfg.seq}, batch {cfg.batch}, pp={cfg.pp}, m={cfg.m}; "
          f"medians of {cfg.steps} steps after {cfg.warmup}; load {load0:.1f} -> {os.getloadavg()[0]:.1f}; ms per step")
    print(f"{'schedule':<12} {'rank':>4} {'main':>7} {'compute':>8} {'outside':>8} {'send':>6} {'process':>8} "
          f"{'recv wait':>9} {'hop med':>8} {'msgs':>5} {'F':>6} {'B':>6} {'W':>6} {'preempt':>7} {'faults':>6}")
    for kind, per_rank in rows.items():
        for r, x in enumerate(per_rank):
            print(f"{kind:<12} {r:>4} {x['main_ms']:>7.1f} {x['compute_ms']:>8.1f} {x['outside_ms']:>8.1f} "
                  f"{x['send_ms']:>6.1f} {x['process_ms']:>8.1f} {x['wait_ms']:>9.1f} {x['hop_median_ms']:>8.2f} "
                  f"{x['messages']:>5} {x['F_ms']:>6.1f} {x['B_ms']:>6.1f} {x['W_ms']:>6.1f} "
                  f"{x['preempted']:>7.0f} {x['faults']:>6.0f}")
        tot = {k: sum(x[k] for x in per_rank) for k in ("compute_ms", "F_ms", "B_ms", "W_ms", "preempted")}
        print(f"{kind:<12}  sum: compute {tot['compute_ms']:.1f} (F {tot['F_ms']:.1f}, B {tot['B_ms']:.1f}, "
              f"W {tot['W_ms']:.1f}); preempted inside compute {tot['preempted']:.0f} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
