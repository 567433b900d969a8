"""Input-free values along the sequence read at fixed positions or along it, under cp
(passes/cp_free_whole.py): computed whole on every rank, nothing moved; cut to this rank's
blocks where they meet the split sequence. Before: "slices positions made from arange over the
sequence ... cp does not yet compute such a value whole" (HF's packed-sequence check in Doge)."""
import pytest

from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_factory_models import grad_diff
from tests.cp_free_models import cut_workload, packed_parity, packed_workload, reference
from tests.parity import max_rel_diff


def test_packed_sequence_check_over_positions_is_computed_whole_without_moving_anything():
    from threefold.codegen.artifact import build_sources
    prog = compile_workload(packed_workload(), "cp=2")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert "gather_seq(" not in code
    assert "shard_seq(" in code          # the whole segment ids meet the split tokens: cut here


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_packed_sequence_check_matches_one_process(cp):
    got = launch(packed_parity, cp, f"cp={cp}", 3, timeout=550)
    ref_losses, ref_grads = reference(packed_workload())
    for losses, grads in got:
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)


def test_slice_of_a_whole_grid_takes_the_bound_of_the_whole_length():
    """s[..., :t - 1] of attention weights computed whole: its bound t - 1 was traced at the
    local length (7 of 8 keys); the model traced at 16 tokens slices to 15, which the whole
    grid takes (was refused as "runs slice along positions computed whole"; compiled silently
    with 7 before that guard)."""
    import re
    from threefold.codegen.artifact import build_sources
    code = build_sources(compile_workload(cut_workload(), "cp=2"))["chunk00.py"].split("def model_outputs")[0]
    assert re.search(r"aten\.slice\.Tensor\(softmax, (3|-1), 0, 15\)", code), code


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slice_of_a_whole_grid_matches_one_process():
    got = launch(packed_parity, 2, "cp=2", 3, ("cut",), timeout=550)
    ref_losses, ref_grads = reference(cut_workload())
    for losses, grads in got:
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-4, grad_diff(grads, ref_grads)


def test_doge_packed_sequence_check_compiles_under_cp():
    """HF Doge at the zoo's batch (4 rows of 8 tokens: its arange(batch) equals s/cp = 4, told
    apart by the model traced at 8 tokens)."""
    from tests.zoo import ZOO
    prog = compile_workload(ZOO["doge"](), "cp=2")
    assert prog.notes


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_doge_matches_one_process_under_cp2():
    from tests.cp_factory_models import reference as zoo_reference, zoo_grads_parity
    from tests.cp_jobs import zoo_batch2
    got = launch(zoo_grads_parity, 2, ["doge"], "cp=2", 3, timeout=850)
    ref_losses, ref_grads = zoo_reference(zoo_batch2("doge"))
    for rank in got:
        losses, grads = rank["doge"]
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)
