"""cp: a number equal to the local length s/cp beside values computed whole is told apart from a
length by the model traced at the whole length (passes/cp_whole.names_length)."""
from __future__ import annotations

import pytest

from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch


def test_a_constant_equal_to_the_local_length_is_not_a_length():
    """DeBERTa-v2 at 8 tokens, cp=2: its log-bucket constant (position_buckets // 2 = 4) equals
    s/cp = 4 beside the relative positions computed whole; the model traced at 8 has the same 4
    there, so it is a constant. Before: a PlanError ("it names the number 4, the local length")."""
    from tests.cp_jobs import zoo_batch2
    prog = compile_workload(zoo_batch2("deberta_v2", 8, 4), "cp=2")
    assert any(n.startswith("cp fallback:") for n in prog.notes)   # the grid is computed whole


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deberta_at_the_local_length_matches_one_process():
    from tests.cp_jobs import zoo_batch2, zoo_parity
    from tests.parity import max_rel_diff, sgd_losses
    got = launch(zoo_parity, 2, ["deberta_v2"], "cp=2", 3, 8, 4, timeout=850)
    ref = sgd_losses(zoo_batch2("deberta_v2", 8, 4), 3)
    for rank in got:
        assert not isinstance(rank["deberta_v2"], str), rank["deberta_v2"]
        assert max_rel_diff(rank["deberta_v2"], ref) < 1e-5, (rank["deberta_v2"], ref)
