"""Memory reuse in the runtime (issue 25 item 2): receive buffers pooled across microbatches
and steps (runtime/buffer_pool.py), glibc malloc kept from returning freed memory
(runtime/allocator.py), and the numbers unchanged."""
import pytest
import torch

from threefold.runtime import allocator
from threefold.runtime.buffer_pool import BufferPool
from threefold.runtime.launch import launch
from tests.parity import max_rel_diff, reference_losses


def test_the_second_microbatch_receives_into_the_first_ones_storage():
    pool = BufferPool()
    first = pool.take((4, 8), torch.float32, "cpu")
    ptr = first.data_ptr()
    first.fill_(1.0)
    del first                                    # microbatch 1 done with it
    second = pool.take((4, 8), torch.float32, "cpu")
    assert second.data_ptr() == ptr and (pool.allocated, pool.reused) == (1, 1)
    other = pool.take((4, 8), torch.float64, "cpu")   # another dtype: its own buffer
    assert other.data_ptr() != ptr and pool.allocated == 2


def test_a_buffer_autograd_still_reads_is_not_handed_out():
    pool = BufferPool()
    x = pool.take((3,), torch.float32, "cpu").copy_(torch.tensor([1.0, 2.0, 3.0])).requires_grad_(True)
    ptr = x.data_ptr()
    loss = (x * x).sum()                         # saves x for backward
    del x
    y = pool.take((3,), torch.float32, "cpu")    # x's bytes are still needed: a new buffer
    assert y.data_ptr() != ptr
    y.fill_(7.0)
    loss.backward()
    del loss, y
    assert pool.take((3,), torch.float32, "cpu").data_ptr() == ptr   # now free again
    view = pool.take((3,), torch.float32, "cpu")[1:]                 # a view keeps it too
    assert view.data_ptr() == ptr + 4
    assert pool.take((3,), torch.float32, "cpu").data_ptr() != ptr


def test_malloc_tuning_leaves_a_users_settings_and_an_opt_out_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert allocator.tune_malloc() == {}
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("THREEFOLD_MALLOC", "default")
    assert allocator.tune_malloc() == {}


def _rank_run(plan: str, steps: int):
    import resource
    import threefold
    from tests.parity import load_workload, parallel_sgd_losses
    torch.set_num_threads(1)
    w = load_workload("gpt", **MODEL)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    losses = parallel_sgd_losses(pm, w, steps)
    pool = pm.engine.recv_pool
    return {"losses": losses, "allocated": pool.allocated, "reused": pool.reused,
            "malloc": dict(allocator.APPLIED), "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}


MODEL = {"n_layer": 4, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_ranks_reuse_receive_buffers_with_unchanged_losses():
    steps, m = 3, 4
    ref = reference_losses("gpt", MODEL, steps)
    for plan in ("pp=2,m=4,schedule=1f1b", "pp=2,m=4,schedule=zbv"):
        ranks = launch(_rank_run, 2, plan, steps)
        for r in ranks:
            assert max_rel_diff(r["losses"], ref) < 1e-5, (plan, r["losses"], ref)
            # every step receives m boundaries per direction; the pool holds only those in flight
            assert r["reused"] > 0 and r["allocated"] < steps * m, (plan, r)
            if allocator.platform.libc_ver()[0] == "glibc":
                assert set(r["malloc"]) == {"mmap_threshold", "trim_threshold"}
