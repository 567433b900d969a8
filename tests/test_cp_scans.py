"""Scans along a split sequence (runtime/cp_scan.py): cumsum, cumprod and logcumsumexp over
time run on each rank's own blocks, each block combined with the carry of the blocks before
it (their totals all-gathered, one position per block), instead of gathering the sequence.
The recurrences written as scans (linear attention, minGRU's log-space scan, a cumprod
decay) then train under cp exactly, with no fallback and under strict=true."""
import pytest

from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_mask_models import mixing_workload

SCANS = ["cumsum", "cumprod", "logcumsumexp"]
ZOO_SCANS = ["hw_linear_attention", "hw_min_gru", "hw_decay_cumprod"]


@pytest.mark.parametrize("mode", SCANS)
def test_a_scan_over_the_sequence_carries_instead_of_gathering(mode):
    prog = compile_workload(mixing_workload(mode), "cp=2,strict=true")   # strict refused the fallback
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert code.count("cp_scan.scan_seq(") == 1 and "cp_gather" not in code, code
    assert not [n for n in prog.notes if n.startswith("cp fallback:")]
    assert any("1 scan(s) along the sequence" in n for n in prog.notes), prog.notes


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
def test_scan_seq_equals_torch_on_the_whole_sequence(cp):
    from tests.cp_scan_jobs import scan_against_torch
    for rank in launch(scan_against_torch, cp, SCANS, cp, timeout=250):
        for kind, (dy, dgrad) in rank.items():
            assert dy < 1e-12 and dgrad < 1e-12, (kind, dy, dgrad)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recurrences_written_as_scans_match_one_process():
    """Losses and every gradient over 3 SGD steps, cp=2 vs one process."""
    from tests.cp_factory_models import grad_diff, reference, zoo_grads_parity
    from tests.cp_jobs import mixing_parity, zoo_batch2
    from tests.parity import max_rel_diff, sgd_losses
    got = launch(zoo_grads_parity, 2, ZOO_SCANS, "cp=2", 3, timeout=850)
    for arch in ZOO_SCANS:
        ref_losses, ref_grads = reference(zoo_batch2(arch))
        for rank in got:
            losses, grads = rank[arch]
            assert max_rel_diff(losses, ref_losses) < 1e-5, (arch, losses, ref_losses)
            assert grad_diff(grads, ref_grads) < 1e-4, (arch, grad_diff(grads, ref_grads))
    mixed = launch(mixing_parity, 2, SCANS, "cp=2", 3, timeout=550)
    for i, mode in enumerate(SCANS):
        ref = sgd_losses(mixing_workload(mode), 3)
        for rank in mixed:
            assert max_rel_diff(rank[i], ref) < 1e-5, (mode, rank[i], ref)


def test_inspect_counts_the_carries_and_the_halos():
    """The collectives inspect lists: a scan's two totals gathered (and their gradients
    all-reduced), a token shift's halos, beside no all-gather of the sequence."""
    from threefold.compiler.collectives import chunk_collectives
    from tests.cp_shift_jobs import shift_workload
    prog = compile_workload(mixing_workload("cumsum"), "cp=2")
    cp = {(e["kind"], e["phase"]): e["elements"] for e in chunk_collectives(prog)[0] if e["group"] == "cp"}
    per_position = 4 * 16   # [4 rows, 8 positions, 16] at the local length: a total is [4, 16]
    assert cp[("all_gather", "forward")] == 2 * per_position, cp
    assert cp[("all_reduce", "backward")] == 2 * 2 * per_position, cp
    shifted = compile_workload(shift_workload(), "cp=2")
    kinds = {e["kind"] for e in chunk_collectives(shifted)[0] if e["group"] == "cp"}
    assert "halo_send" in kinds and "all_gather" not in kinds, kinds
