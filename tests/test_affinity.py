"""THREEFOLD_PIN=cores pins each local rank (and gloo's threads) to cores of its own."""
import os

import pytest

from threefold import PlanError
from threefold.runtime import affinity


def test_blocks_of_threads_wrap_around_when_cores_run_out():
    # 4 single-thread ranks on 2 cores: neighbours on different cores (0,2 | 1,3)
    assert [affinity.rank_cores(r, 1, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]
    # enough cores: disjoint blocks, in the allowed set's order (not 0..n-1)
    assert [affinity.rank_cores(r, 2, [2, 3, 5, 7]) for r in range(2)] == [[2, 3], [5, 7]]
    # more threads than cores: every core, once
    assert affinity.rank_cores(1, 8, [0, 1]) == [0, 1]


def test_mode_is_checked(monkeypatch):
    monkeypatch.delenv(affinity.ENV, raising=False)
    assert affinity.mode() == "none"
    monkeypatch.setenv(affinity.ENV, "Cores")
    assert affinity.mode() == "cores"
    monkeypatch.setenv(affinity.ENV, "yes")
    with pytest.raises(PlanError, match="THREEFOLD_PIN='yes' is invalid: use THREEFOLD_PIN=cores"):
        affinity.mode()


def test_bad_value_fails_before_ranks_start(monkeypatch):
    from threefold.runtime.launch import launch
    monkeypatch.setenv(affinity.ENV, "2")
    with pytest.raises(PlanError, match="THREEFOLD_PIN"):
        launch(_cores_of_every_thread, 2)


def _cores_of_every_thread():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)      # gloo's threads exist and ran
    return {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
def test_ranks_and_their_threads_are_pinned(monkeypatch):
    from threefold.runtime.launch import launch
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv(affinity.ENV, "cores")
    ranks = launch(_cores_of_every_thread, 2, timeout=120)
    for r, threads in enumerate(ranks):
        want = affinity.rank_cores(r, 1, allowed)
        assert len(threads) >= 2 and all(cores == want for cores in threads.values()), (r, want, threads)
    monkeypatch.delenv(affinity.ENV)
    free = launch(_cores_of_every_thread, 2, timeout=120)
    assert all(cores == allowed for threads in free for cores in threads.values())
