"""A sequence shortened inside the model under cp (passes/cp_tails.py): a model that takes the
whole token row and shifts it itself (logits[:, :-1] against labels x[:, 1:], as
x-transformers' AutoregressiveWrapper) keeps every rank's positions, the last of the whole
sequence standing for nothing; the labels' shift is a halo exchange, the loss's sum skips the
dropped position and its denominator counts the labels of whole sequences. Before: "slice at
<top> slices along the sequence (dim 1; a shift such as x[:, :-1] inside the model? ...)"."""
import pytest

import threefold
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_factory_models import grad_diff
from tests.cp_tail_models import reference, tail_parity, tail_workload, zoo_tail_parity
from tests.parity import max_rel_diff

FORMS = ["ce", "sum"]


@pytest.mark.parametrize("form", FORMS)
def test_a_shift_inside_the_model_keeps_the_positions_and_moves_no_sequence(form):
    from threefold.codegen.artifact import build_sources
    prog = compile_workload(tail_workload(form), "cp=2")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert code.count("cp_shift.shift_seq(") == 1 and code.count("cp_tail.drop_tail(") == 1
    assert "gather_seq(" not in code
    assert prog.loss_form["whole_along"] == ["cp"]


def test_what_mixes_the_shortened_positions_is_refused_in_one_line():
    with pytest.raises(threefold.PlanError, match="softmax at <top> reads a value shortened along the sequence") \
            as err:
        compile_workload(tail_workload("softmax"), "cp=2")
    assert "\n" not in str(err.value)


def test_a_mean_pooled_over_the_shortened_positions_leaves_the_dropped_one_out():
    """logits[:, :-1].mean(1): all-reduced partial sums (cp_gather.reduce_seq) without the
    dropped last position, counted over the s - 1 that exist. Before: refused."""
    from threefold.codegen.artifact import build_sources
    code = build_sources(compile_workload(tail_workload("leak"), "cp=2"))["chunk00.py"]
    assert "cp_gather.reduce_seq(" in code and "tail=1" in code, code


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_mean_pooled_over_the_shortened_positions_matches_one_process():
    got = launch(tail_parity, 2, ["leak"], "cp=2", 3, timeout=550)
    ref_losses, ref_grads = reference(tail_workload("leak"))
    for rank in got:
        losses, grads = rank[0]
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)


def test_an_element_mean_over_the_shortened_sequence_is_refused_not_trained_wrong():
    """mse_loss (mean) over logits[:, :-1]: its denominator, the number of elements, is b*(n-1)
    per rank as traced, b*(s-cp) over the ranks, not b*(s-1): refused in one line."""
    with pytest.raises(threefold.PlanError, match="a mean over its elements") as err:
        compile_workload(tail_workload("mse"), "cp=2")
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan,ranks", [("cp=2", 2), ("cp=4", 4), ("dp=2,cp=2", 4)])
def test_a_shift_inside_the_model_matches_one_process(plan, ranks):
    """dp=2,cp=2: the denominator is read from each dp rank's whole sequences."""
    got = launch(tail_parity, ranks, FORMS, plan, 3, timeout=550)
    for i, form in enumerate(FORMS):
        ref_losses, ref_grads = reference(tail_workload(form))
        for rank in got:
            losses, grads = rank[i]
            assert max_rel_diff(losses, ref_losses) < 1e-5, (form, losses, ref_losses)
            assert grad_diff(grads, ref_grads) < 1e-5, (form, grad_diff(grads, ref_grads))


@pytest.mark.zoo   # needs the `zoo` extra (x-transformers); the default tier has the hand-written self-shift
def test_x_transformers_autoregressive_wrapper_compiles_under_cp():
    from tests.zoo import ZOO
    prog = compile_workload(ZOO["xt_autoregressive"](), "cp=2")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2, 4])
def test_x_transformers_autoregressive_wrapper_matches_one_process(cp):
    """At cp=4 its 8 tokens are 2 per rank: the labels' reshape (4, 1) -> (4, 1, 1) names the
    shortened length 1 twice, told apart by the model traced at the whole length."""
    from tests.cp_jobs import zoo_batch2
    got = launch(zoo_tail_parity, cp, "xt_autoregressive", f"cp={cp}", 3, timeout=850)
    ref_losses, ref_grads = reference(zoo_batch2("xt_autoregressive"))
    for losses, grads in got:
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)


def test_hf_labels_shift_is_a_halo_with_its_fill():
    """A Hugging Face causal LM called with labels=: its loss pads the labels with -100 at the end
    and reads them from position 1 (was refused: "pad at model pads (shifts) along the
    sequence"): one shift with the fill, its denominator counted over whole sequences."""
    from threefold.codegen.artifact import build_sources
    from tests.own_loss_jobs import hf_labels
    w = hf_labels("llama")
    prog = compile_workload({"model": w["model"], "inputs": w["inputs"]}, "cp=2", own_loss=True)
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes
    assert "cp_tail.shift_fill(" in build_sources(prog)["chunk00.py"]
    assert prog.loss_form["whole_along"] == ["cp"]
    from threefold.compiler.collectives import chunk_collectives
    halos = {(e["kind"], e["phase"]): e["elements"] for e in chunk_collectives(prog)[-1] if e["group"] == "cp"}
    assert halos.get(("halo_send", "forward")) == 2 * 4, halos   # one label per halo, 4 rows, two halos


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_labels_loss_matches_one_process_under_cp2():
    """Loss and gradient norm of 3 SGD steps (some labels ignored: the denominator differs per
    rank's share), against one process."""
    from tests.own_loss_jobs import parallel, reference as own_reference
    got = launch(parallel, 2, [("llama", "cp=2")], 3, timeout=550)
    ref = own_reference("llama", 3)
    for rank in got:
        assert not isinstance(rank[0], str), rank[0]
        assert max_rel_diff([l for l, _ in rank[0]], [l for l, _ in ref]) < 1e-5, (rank[0], ref)
        assert max_rel_diff([g for _, g in rank[0]], [g for _, g in ref]) < 1e-5, (rank[0], ref)
