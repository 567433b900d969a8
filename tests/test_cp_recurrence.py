"""Loops over time steps under cp (passes/cp_recurrence.py, runtime/cp_recur.py): a recurrence
written as a Python loop (`for t in range(T): h = f(h, x[:, t])`, RWKV's WKV on CPU) is
unrolled in the trace; each rank runs its own two blocks of steps, the first from the state
rank r-1's first block ends with, the second from the end of rank r+1's second block (the
end of a block the trace does not compute is A's state computation again on B's positions).
Exact (losses and every gradient against one process), sequential across the ranks."""
import pytest

import threefold
from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_jobs import zoo_batch2
from tests.cp_shift_jobs import shift_workload

LOOPS = ["hw_gated_loop", "hw_two_state_loop"]


def _code(w, plan: str) -> str:
    return build_sources(compile_workload(w, plan))["chunk00.py"].split("def model_outputs")[0]


@pytest.mark.parametrize("arch", LOOPS + ["rwkv"])
def test_a_loop_over_time_steps_hands_its_state_rank_to_rank(arch):
    """Before: "select at ... reads the sequence one position at a time ...: a recurrence over
    time steps" (a PlanError, also for the zoo's RWKV)."""
    prog = compile_workload(zoo_batch2(arch), "cp=2,strict=true")
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    for op in ("recur_start(", "recur_mid(", "recur_end("):
        assert code.count(f"cp_recur.{op}") == 2, (op, code)   # one per decoder layer
    assert "cp_gather" not in code and not [n for n in prog.notes if n.startswith("cp fallback:")]
    assert any("2 loop(s) over time steps hand their state rank to rank" in n and "sequential" in n
               for n in prog.notes), prog.notes


def test_inspect_lists_the_state_hand_off():
    """The state each loop hands on (to r+1 its start, to r-1 the end of its second block), per
    microbatch, beside the token shifts' halos; no all-gather of the sequence."""
    from threefold.compiler.collectives import chunk_collectives
    prog = compile_workload(zoo_batch2("hw_gated_loop"), "cp=2")
    cp = {(e["kind"], e["phase"]): e for e in chunk_collectives(prog)[0] if e["group"] == "cp"}
    state = 2 * 32   # h: [2 rows, 32 features], handed to both neighbours
    assert cp[("state_send", "forward")]["elements"] == 2 * state, cp
    assert cp[("state_send", "forward")]["count_per_microbatch"] == 2, cp   # two layers
    assert cp[("state_send", "backward")]["elements"] == 2 * state, cp
    assert not any(k == "all_gather" for k, _ in cp), cp


@pytest.mark.parametrize("model, why", [
    ("FinalState", r"reads a value of step 7 after the loop"),
    ("StepCounter", r"the steps are not one loop body"),
    ("LookAhead", r"cp cannot hand its state rank to rank"),
])
def test_a_loop_cp_cannot_hand_on_is_named_in_one_line(model, why):
    from tests import cp_loop_models
    w = shift_workload()
    w["model"] = getattr(cp_loop_models, model)()
    with pytest.raises(threefold.PlanError, match=r"reads the sequence one position at a time .*" + why) as err:
        compile_workload(w, "cp=2")
    assert "\n" not in str(err.value)


def test_one_position_read_is_not_a_loop():
    """CLS pooling is one global position read from the rank that holds it (cp_gather.select_seq;
    parity in tests/test_cp_birth.py), not a loop handed rank to rank."""
    from threefold.codegen.artifact import build_sources
    from tests.cp_loop_models import FirstToken
    w = shift_workload()
    w["model"] = FirstToken()
    prog = compile_workload(w, "cp=2")
    assert "select_seq(" in build_sources(prog)["chunk00.py"]
    assert not any("hand" in n and "loop" in n for n in prog.notes if not n.startswith("cp=2:")), prog.notes


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_loops_match_one_process(cp):
    """Losses and every gradient over 3 SGD steps, fp32, against one process."""
    from tests.cp_factory_models import assert_zoo_archs_match
    from tests.cp_loop_models import loop_parity
    assert_zoo_archs_match(launch(loop_parity, cp, LOOPS, f"cp={cp}", 3, timeout=550), LOOPS)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rwkv_matches_one_process_under_cp():
    """The zoo's HF RWKV (WKV loop with num, den, max states; its token shifts as halos)."""
    from tests.cp_factory_models import grad_diff, reference
    from tests.cp_loop_models import loop_parity
    from tests.parity import max_rel_diff
    got = launch(loop_parity, 2, ["rwkv"], "cp=2", 3, timeout=550)
    ref_losses, ref_grads = reference(zoo_batch2("rwkv"))
    for rank in got:
        losses, grads = rank["rwkv"]
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["cp=2,tp=2", "cp=2,pp=2,m=2"])
def test_loops_compose_with_tp_and_pp(plan):
    """Losses over 3 SGD steps against one process (each rank holds only its shards, so the
    losses carry the check of every update)."""
    from tests.cp_factory_models import reference
    from tests.cp_loop_models import loop_parity
    from tests.parity import max_rel_diff
    archs = ["hw_gated_loop", "rwkv"]
    got = launch(loop_parity, 4, archs, plan, 3, timeout=550)
    for arch in archs:
        ref_losses, _ = reference(zoo_batch2(arch))
        for rank in got:
            assert max_rel_diff(rank[arch][0], ref_losses) < 1e-5, (arch, rank[arch][0], ref_losses)


def test_mamba_selective_scan_loop_is_handed_on():
    """HF Mamba on CPU: tensor_split(x, [T], dim=seq) (the whole sequence and an empty cached
    tail) stays split (before: "slices along the sequence"), its causal conv1d exchanges halos
    and the selective scan's loop over time steps hands its state rank to rank."""
    from tests.cp_loop_models import hf_mamba
    prog = compile_workload(hf_mamba(), "cp=2,strict=true")
    notes = " ".join(prog.notes)
    assert "2 causal conv1d(s) exchange halos" in notes and "2 loop(s) over time steps" in notes, notes


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_mamba_matches_one_process_under_cp(cp):
    from tests.cp_factory_models import grad_diff, reference
    from tests.cp_loop_models import hf_mamba, mamba_parity
    from tests.parity import max_rel_diff
    ref_losses, ref_grads = reference(hf_mamba(seq=8 * cp))
    for losses, grads in launch(mamba_parity, cp, f"cp={cp}", 8 * cp, 3, timeout=550):
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)
