"""cp on a sequence padded for its 2cp blocks (passes/cp_padding.py), where values are computed
whole on every rank (a grid of positions, cp_whole.py; an input-free value rebuilt whole,
cp_free_whole.py): computed at the real length S, as one process computes them. Before: refused,
"the sequence is padded to 8 positions for cp's 4 blocks, and a grid of positions computed whole
would pair the real ones with the padding" / "computed whole it would run past the real end"."""
import pytest

import threefold
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_factory_models import grad_diff
from tests.cp_uneven_models import reference, uneven_parity, workload
from tests.parity import max_rel_diff

# DeBERTa-v2 (disentangled relative attention: grids of relative positions), Doge (a packed-sequence
# check on position_ids[:, :1], a dynamic mask), RetNet-style retention and lightning attention over
# one block (decay grids), MiniMax (lightning attention inside an HF model)
ZOO = ["zoo:deberta_v2@7", "zoo:hw_retention@7", "zoo:hw_lightning@7", "zoo:doge@7", "zoo:minimax@7"]
SMALL = ["relpos@7", "packed@7"]   # a relative-position grid from arange; HF's packed-sequence check


def _check(got: list, names: list, grad_tol: float = 1e-5) -> None:
    for i, name in enumerate(names):
        ref_losses, ref_grads = reference(workload(name))
        for rank in got:
            losses, grads = rank[i]
            assert max_rel_diff(losses, ref_losses) < 1e-5, (name, losses, ref_losses)
            assert grad_diff(grads, ref_grads) < grad_tol, (name, grad_diff(grads, ref_grads))


@pytest.mark.parametrize("name", SMALL + ZOO)
def test_a_value_computed_whole_on_a_padded_sequence_compiles(name):
    prog = compile_workload(workload(name), "cp=2")
    assert prog.seq_tail == 1


def test_a_view_of_a_whole_value_grows_to_the_real_length_not_a_multiple():
    """The local 4 positions grow to 7 (not 4 * cp = 8): a view carries the whole size itself."""
    from threefold.passes.cp_whole import _view_size
    assert _view_size((2, 4, 16), (2, 7, 16), (2, 4, 2, 8)) == [2, 7, 2, 8]
    assert _view_size((2, 4, 4), (2, 7, 7), (8, 4)) == [14, 7]        # rows merged into one dim: their product


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_small_whole_values_on_7_tokens_match_one_process_under_cp2():
    got = launch(uneven_parity, 2, SMALL, "cp=2", 3, timeout=550)
    _check(got, SMALL)


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2, 4])
def test_zoo_whole_values_on_7_tokens_match_one_process(cp):
    """cp=4: a rank holds 2 of the 8 padded positions, the whole 7 no multiple of them."""
    got = launch(uneven_parity, cp, ZOO, f"cp={cp}", 3, timeout=850)
    _check(got, ZOO)


# 9 tokens at cp=2: padded to 12, a rank holds 6, so the whole length is no multiple of the local one and the
# padding is 3 positions (the retention and lightning models' decay tables hold 8 rows: one process refuses 9)
AT_9 = ["relpos@9", "packed@9", "zoo:deberta_v2@9", "zoo:doge@9", "zoo:minimax@9"]


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.timeout(900)
def test_whole_values_on_9_tokens_match_one_process_under_cp2():
    got = launch(uneven_parity, 2, AT_9, "cp=2", 3, timeout=850)
    _check(got, AT_9)
