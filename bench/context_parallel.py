"""Context parallelism: activation bytes per rank (measured and the memory model's estimate)
and ring bytes per step (measured and the ring formula), at cp = 1, 2, 4.

    python bench/context_parallel.py [seq]      the table below
    python bench/context_parallel.py demo       seq 16384: 3 SGD steps at cp=4, estimates at cp=1/4
    python bench/context_parallel.py torch      torch's own context_parallel on CPU/gloo (it does not run)

GPT (examples/gpt.py), 2 layers, width 32, 2 heads, batch 1, seq 4096 by default. Measured:
PeakSavedCounter over one real step on each rank (runtime/memory.py); the estimate is
planner/memory.program_memory for that rank. Ring bytes: every torch.distributed.isend a
rank posts in one step (pp=1: only ring attention sends), against the formula per layer
K+V of s/cp tokens, cp-1 hops forward; K+V (cp-1 hops) and dK+dV (cp hops) backward.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from threefold.runtime.launch import launch  # noqa: E402

LAYERS, WIDTH, HEADS = 2, 32, 2


def one_rank(plan: str, seq: int) -> dict:
    import torch.distributed as dist

    import threefold
    from threefold.compiler.api import compile_workload
    from threefold.planner.memory import program_memory
    from threefold.runtime.memory import PeakSavedCounter
    from examples.gpt import workload
    torch.set_num_threads(1)
    w = workload(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, seq=seq, batch=1)
    prog = compile_workload(w, plan)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    est = next(r for r in program_memory(prog) if r.rank == rank).to_json()["activations"]
    state = [t for m in pm.engine.modules.values() for t in list(m.parameters()) + list(m.buffers())]
    sent = [0]
    real_isend = dist.isend

    def counting(t, *a, **k):
        sent[0] += t.numel() * t.element_size()
        return real_isend(t, *a, **k)
    dist.isend = counting
    try:
        start = time.perf_counter()
        with PeakSavedCounter(exclude=state) as counter:
            loss = pm.step(*w["inputs"], target=w["target"])
        seconds = time.perf_counter() - start
    finally:
        dist.isend = real_isend
    return {"rank": rank, "measured": counter.peak_bytes, "estimate": est, "sent": sent[0],
            "loss": loss, "seconds": seconds}


def ring_formula(seq: int, cp: int) -> int:
    """Bytes one rank sends per step: per layer K and V of s/cp tokens (fp32)."""
    kv = 2 * 1 * seq // cp * WIDTH * 4
    return LAYERS * kv * ((cp - 1) + (cp - 1) + cp) if cp > 1 else 0


def main(seq: int = 4096) -> None:
    rows = []
    for cp in (1, 2, 4):
        plan = f"cp={cp}"
        res = launch(one_rank, cp, plan, seq, timeout=900) if cp > 1 else [one_rank(plan, seq)]
        r0 = max(res, key=lambda r: r["measured"])
        rows.append((cp, r0, max(r["sent"] for r in res), res[0]["loss"], max(r["seconds"] for r in res)))
    base = rows[0][1]["measured"]
    print(f"GPT {LAYERS} layers, width {WIDTH}, {HEADS} heads, batch 1, seq {seq}")
    print("cp  activations/rank measured  estimate  est/meas  vs cp=1  ring sent/step  formula  loss       step s")
    for cp, r, sent, loss, secs in rows:
        print(f"{cp:>2}  {r['measured'] / 2**20:>20.2f} MiB  {r['estimate'] / 2**20:>6.2f} MiB  "
              f"{r['estimate'] / r['measured']:>8.3f}  {r['measured'] / base:>7.3f}  "
              f"{sent / 2**20:>10.2f} MiB  {ring_formula(seq, cp) / 2**20:>5.2f} MiB  {loss:.6f}  {secs:.2f}")


def train_rank(plan: str, seq: int, steps: int) -> dict:
    import threefold
    from threefold.runtime.memory import PeakSavedCounter
    from examples.gpt import workload
    torch.set_num_threads(1)
    w = workload(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, seq=seq, batch=1)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    opt = pm.optimizer(torch.optim.SGD, lr=0.1)
    state = [t for m in pm.engine.modules.values() for t in list(m.parameters()) + list(m.buffers())]
    losses, start = [], time.perf_counter()
    with PeakSavedCounter(exclude=state) as counter:
        for _ in range(steps):
            opt.zero_grad()
            losses.append(pm.step(*w["inputs"], target=w["target"]))
            opt.step()
    return {"losses": losses, "activations": counter.peak_bytes, "seconds": time.perf_counter() - start}


def demo(seq: int = 16384, steps: int = 3) -> None:
    from threefold.compiler.api import compile_workload
    from threefold.planner.memory import program_memory
    from examples.gpt import workload
    est = {}
    for cp in (1, 4):
        w = workload(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, seq=seq, batch=1)
        est[cp] = program_memory(compile_workload(w, f"cp={cp}"))[0]
    res = launch(train_rank, 4, "cp=4", seq, steps, timeout=1500)
    print(f"GPT {LAYERS} layers, width {WIDTH}, {HEADS} heads, batch 1, seq {seq}")
    for cp in (1, 4):
        e = est[cp]
        print(f"estimate cp={cp}: activations {e.activations / 2**20:.1f} MiB, total {e.total / 2**20:.1f} MiB per rank")
    r = max(res, key=lambda x: x["activations"])
    print(f"cp=4 trained {steps} steps in {r['seconds']:.1f} s: losses {['%.6f' % x for x in r['losses']]}, "
          f"measured activations {r['activations'] / 2**20:.1f} MiB per rank (max over ranks)")
    print(f"cp=1 estimate / cp=4 estimate: activations {est[1].activations / est[4].activations:.1f}x, "
          f"total {est[1].total / est[4].total:.1f}x")


def torch_job():
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ran"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    if sys.argv[1:] == ["demo"]:
        demo()
    elif sys.argv[1:] == ["torch"]:
        print(f"torch {torch.__version__} context_parallel, cp=2 on gloo/CPU:", launch(torch_job, 2, timeout=400)[0])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
