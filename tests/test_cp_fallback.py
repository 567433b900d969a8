"""The all-gather fallback of context parallelism (passes/cp_fallback.py, runtime/cp_gather.py):
ops that mix sequence positions (a running max over time, a non-causal conv, mean over the sequence)
run on the gathered sequence (a sum or mean over it: partial sums all-reduced), are listed with their bytes, refused under strict=true, and
equal one process at cp=2 (fp32, 3 SGD steps)."""
import pytest

import threefold
from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_jobs import mixing_parity
from tests.cp_mask_models import mixing_workload
from tests.parity import max_rel_diff, sgd_losses

MODES = ["cummax", "conv", "pool"]


@pytest.mark.parametrize("mode,op,cut", [("cummax", "cummax", True), ("conv", "conv1d", True)])
def test_fallback_gathers_around_the_op_and_lists_its_bytes(mode, op, cut):
    prog = compile_workload(mixing_workload(mode), "cp=2,m=2")
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert code.count("cp_gather.gather_seq(") == 1 and code.count("cp_gather.shard_seq(") == int(cut)
    notes = [n for n in prog.notes if n.startswith("cp fallback:")]
    # [2 rows, 8 positions, 16] fp32 per microbatch, gathered from 1 peer, forward + backward, m=2
    assert len(notes) == 1 and f"{op} (" in notes[0] and f"{2 * 2 * 2 * 8 * 16 * 4} bytes per rank per step" in notes[0]


def test_a_mean_over_the_sequence_sums_each_rank_and_all_reduces_instead():
    """Pooling over the sequence (the `pool` mode) moves [rows, features], not the sequence: each
    rank's partial sum all-reduced (runtime/cp_gather.reduce_seq); it was the all-gather fallback."""
    prog = compile_workload(mixing_workload("pool"), "cp=2,m=2")
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert "cp_gather.reduce_seq(" in code and "gather_seq(" not in code
    assert not [n for n in prog.notes if n.startswith("cp fallback:")]


def test_strict_plan_refuses_the_fallback_in_one_line():
    with pytest.raises(threefold.PlanError, match="strict plan: cummax at <top> mixes sequence positions") as err:
        compile_workload(mixing_workload("cummax"), "cp=2,strict=true")
    assert "\n" not in str(err.value) and "cp=1" in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fallback_cp2_matches_one_process():
    got = launch(mixing_parity, 2, MODES, "cp=2", 3, timeout=550)
    for i, mode in enumerate(MODES):
        ref = sgd_losses(mixing_workload(mode), 3)
        for rank in got:
            assert max_rel_diff(rank[i], ref) < 1e-5, (mode, rank[i], ref)


def test_batch_norm_over_merged_tokens_is_gathered_through_its_digits():
    """BatchNorm1d over [b*t, C] tokens (the sequence merged with the batch): its statistics
    run over every token, so the [b, n] digits are gathered to [b, s] and cut back
    (was a refusal: "merged with another dim")."""
    from tests.cp_jobs import zoo_batch2
    prog = compile_workload(zoo_batch2("hw_batchnorm"), "cp=2")
    notes = [n for n in prog.notes if n.startswith("cp fallback:")]
    assert len(notes) == 1 and notes[0].startswith("cp fallback: batch_norm ("), notes


def test_capacity_queue_on_a_padded_sequence_is_refused_not_trained_wrong():
    """An expert capacity queue (cumsum over every token of the batch, compared with a capacity
    the model computes from its token count) reads one process's capacity from the model traced
    at the whole length (passes/cp_counts.py, tests/test_cp_counts.py); a sequence padded to 2cp
    blocks has no such trace (the padding would count), so it is refused in one line, naming it."""
    import threefold
    from tests.cp_jobs import zoo_batch2
    with pytest.raises(threefold.PlanError, match="capacity queue.*multiple of 4") as err:
        compile_workload(zoo_batch2("hw_moe_capacity", 7), "cp=2")
    assert "\n" not in str(err.value)
