"""Store round trips: what a dry run counts per rank (runtime/store_rounds.py: the calls
made through the store plus the real backend's rendezvous of every group joined) equals
what a real 4-rank gloo job makes on a counting store wrapped around its TCPStore."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from threefold.runtime.store_rounds import add_ops, backend_store_ops

GPT = "examples/gpt.py:workload"


def test_backend_rules_per_joined_group():
    joined = [(0, 1, 2, 3), (0, 1), (1, 3)]
    assert backend_store_ops(joined, 1) == {"set": 3, "wait": 8, "get": 8}
    # nccl: the group's first member sets the unique id, the others read it
    assert backend_store_ops(joined, 1, "nccl") == {"set": 1, "wait": 2, "get": 2}
    assert add_ops({"check": 1, "set": 1}, {"set": 2}) == {"check": 1, "set": 3}
    with pytest.raises(ValueError, match="gloo"):
        backend_store_ops(joined, 1, "mpi")


def test_the_dry_run_counts_every_joined_groups_rendezvous():
    from tests.dry_faults import compile_for_dry_run
    from threefold.runtime.dry_run import DrySource, dry_run_rank, meta_batch
    w, sources, manifest = compile_for_dry_run(GPT, "tp=2,dp=2")
    run = dry_run_rank(manifest, DrySource(sources), 1, meta_batch(tuple(w.inputs) + (w.target,)), memory=False)
    # world (4) + its tp pair + its dp pair: 3 sets, 4 + 2 + 2 waits and gets
    assert run.groups_joined == 2 and run.store_ops == {"get": 8, "set": 3, "wait": 8}


def _real_rank(rank: int, world: int, port: int, spec: str, plan: str, queue) -> None:
    import os
    os.environ.update(THREEFOLD_LOCAL_P2P="0", THREEFOLD_LOCAL_REDUCE="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    from tests.dry_faults import RandomWeights, compile_for_dry_run
    from threefold.runtime.assemble import assemble_rank
    from threefold.runtime.dry_run import CountingStore, _step
    from threefold.runtime.optimizers import make_optimizer
    try:
        w, sources, manifest = compile_for_dry_run(spec, plan)   # before joining: no store call waits on it
        store = CountingStore(dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        engine = assemble_rank(manifest, RandomWeights(sources), rank, torch.device("cpu"))
        opt = make_optimizer(engine, torch.optim.Adam, None, lr=1e-3, foreach=False)
        _step(engine, opt, tuple(w.inputs) + (w.target,))
        queue.put((rank, dict(store.calls)))
    except BaseException as exc:  # noqa: BLE001  reported to the test, which fails naming it
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def real_store_calls(spec: str, plan: str, world: int = 4) -> dict[int, dict]:
    """Each rank's store calls by kind in a real gloo job (init, assembly, one step)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    master = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False,  # noqa: F841  hosts the keys
                           timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_real_rank, args=(r, world, port, spec, plan, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["tp=2,dp=2", "pp=2,dp=2,m=2"])
def test_dry_run_store_calls_equal_a_real_gloo_jobs(plan, monkeypatch):
    from tests.dry_faults import compile_for_dry_run
    from threefold.runtime.dry_run import DrySource, dry_run_job, meta_batch
    real = real_store_calls(GPT, plan)
    w, sources, manifest = compile_for_dry_run(GPT, plan)
    dry = dry_run_job(manifest, DrySource(sources), meta_batch(tuple(w.inputs) + (w.target,)), all_ranks=True)
    for r in range(4):
        assert isinstance(real[r], dict), real[r]
        assert dry.runs[r].store_ops == real[r], (r, dry.runs[r].store_ops, real[r])
