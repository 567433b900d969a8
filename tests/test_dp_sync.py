"""The data-parallel step synchronises its ranks once: at the gradient reduction.

The loss's denominator (the number of targets != ignore_index over the global batch) is
counted by every rank over the global batch it holds, and the gradient norm of replicated
gradients is computed where they are: neither is an all-reduce any more (each was a wait for
the slowest rank). The workload ignores positions 4-10 of every row and one more in row 0,
so dp ranks (rows) and cp ranks (positions) count different numbers of tokens: a
denominator of this rank's share times the ranks would be off, and the losses, norms and
clipped updates are compared with one process's.
"""
import pytest

from tests.dp_sync_jobs import clipped_losses, reference
from tests.parity import max_rel_diff
from threefold.runtime.launch import launch

STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["dp=2,m=2", "cp=2"])
def test_masked_mean_and_norm_without_their_all_reduces(plan):
    ref_losses, ref_norms = reference(STEPS)
    for r in launch(clipped_losses, 2, plan, STEPS, timeout=280):
        assert max_rel_diff(r["losses"], ref_losses) < 1e-5, (plan, r["losses"], ref_losses)
        assert max_rel_diff(r["norms"], ref_norms) < 1e-5, (plan, r["norms"], ref_norms)
        # per step one all-reduce: the shared-memory gradient exchange's barrier, which sums
        # the loss on the way (runtime/local_reduce.py); before the first step, its set-up
        setup, steps = _split_setup(r["all_reduces"])
        assert setup == ["shared-memory set-up"] * 4, r["all_reduces"]   # incl. the proof pages are shared
        assert steps == ["gradients and the loss"] * STEPS, r["all_reduces"]


def _split_setup(issued: list[str]) -> tuple[list[str], list[str]]:
    n = next(i for i, what in enumerate(issued) if what != "shared-memory set-up")
    return issued[:n], issued[n:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("why", ["THREEFOLD_LOCAL_REDUCE=0", "another host"])
def test_gloo_path_when_shared_memory_is_off(monkeypatch, tmp_path, why):
    """THREEFOLD_LOCAL_REDUCE=0, or a rank that cannot see the segment (another host; here
    rank 1 looks in its own directory, where torch.from_file would create a fresh, unshared
    file): gloo all-reduces the gradient bucket and the loss on every rank, the same numbers."""
    own = None
    if why == "another host":
        own = str(tmp_path)
    else:
        monkeypatch.setenv("THREEFOLD_LOCAL_REDUCE", "0")
    ref_losses, ref_norms = reference(STEPS)
    for r in launch(clipped_losses, 2, "dp=2,m=2", STEPS, own, timeout=280):
        assert max_rel_diff(r["losses"], ref_losses) < 1e-5, (r["losses"], ref_losses)
        assert max_rel_diff(r["norms"], ref_norms) < 1e-5, (r["norms"], ref_norms)
        setup, steps = _split_setup(r["all_reduces"])
        assert setup == ["shared-memory set-up"] * 2, r["all_reduces"]
        assert sorted(steps) == sorted(["gradients", "the loss"] * STEPS), r["all_reduces"]
    assert not list(tmp_path.iterdir())     # nothing left behind where rank 1 looked
