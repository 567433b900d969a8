"""cp on sequences whose length 2*cp does not divide (passes/cp_padding.py): padded to 2cp
blocks at the runtime's cut, the padding left out wherever positions mix. Before: "cp=2 splits
the sequence into 2*cp=4 blocks, but input 0 has 7 positions (dim 1); use a sequence length
that is a multiple of 4"."""
import pytest
import torch

import threefold
from threefold.compiler.api import compile_workload
from threefold.runtime import cp_ops
from threefold.runtime.launch import launch
from tests.cp_factory_models import grad_diff
from tests.cp_uneven_models import FORMS, encoder_workload, reference, uneven_parity, workload
from tests.parity import max_rel_diff


def _check(got: list, names: list, whole: bool = True, grad_tol: float = 1e-5) -> None:
    """Losses and every gradient against one process; `whole=False` (tp, pp: a rank holds a
    shard or a stage): the gradients this rank holds whole (one at least)."""
    for i, name in enumerate(names):
        ref_losses, ref_grads = reference(workload(name))
        for rank in got:
            losses, grads = rank[i]
            assert max_rel_diff(losses, ref_losses) < 1e-5, (name, losses, ref_losses)
            if not whole:
                keep = [k for k in grads[0] if k in ref_grads[0] and grads[0][k].shape == ref_grads[0][k].shape]
                assert keep, sorted(grads[0])
                grads = [{k: g[k] for k in keep} for g in grads]
                ref_grads = [{k: r[k] for k in keep} for r in ref_grads]
            assert grad_diff(grads, ref_grads) < grad_tol, (name, grad_diff(grads, ref_grads))


def test_the_pad_is_one_function_of_the_length():
    x = torch.arange(14).view(2, 7)
    assert cp_ops.seq_tail(7, 2) == 1 and cp_ops.seq_tail(8, 2) == 0 and cp_ops.seq_tail(7, 4) == 1
    assert cp_ops.seq_tail(9, 4) == 7 and cp_ops.seq_tail(5, 1) == 0
    padded = cp_ops.pad_to_blocks(x, 1, 2)
    assert padded.shape == (2, 8) and padded[:, :7].equal(x) and not padded[:, 7].any()
    # rank 0 holds blocks 0 and 3 of the padded sequence, rank 1 blocks 1 and 2
    assert cp_ops.local_blocks(x, 1, 2, 0)[0].tolist() == [0, 1, 6, 0]
    assert cp_ops.local_blocks(x, 1, 2, 1)[0].tolist() == [2, 3, 4, 5]


def test_gpt_on_7_tokens_compiles_under_cp2_with_the_padding_left_out():
    from threefold.codegen.artifact import build_sources
    from tests.zoo import ZOO
    prog = compile_workload(ZOO["gpt_seq7"](), "cp=2")
    assert prog.seq_tail == 1 and prog.seq_len == 4
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes
    assert "padded to 8" in prog.notes[0]
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert code.count("cp_tail.drop_tail(") == 1 and "limit=7" in code   # the loss's sum; positions clamped
    assert prog.loss_form["whole_along"] == ["cp"]   # the labels counted on the unpadded sequences


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpt_on_7_tokens_matches_one_process_under_cp2():
    got = launch(uneven_parity, 2, ["zoo:gpt_seq7"], "cp=2", 3, timeout=550)
    _check(got, ["zoo:gpt_seq7"])


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("plan,ranks", [("cp=4", 4), ("dp=2,cp=2", 4), ("tp=2,cp=2", 4), ("pp=2,cp=2", 4)])
def test_gpt_on_7_tokens_matches_one_process(plan, ranks):
    got = launch(uneven_parity, ranks, ["zoo:gpt_seq7"], plan, 3, timeout=850)
    _check(got, ["zoo:gpt_seq7"], whole=not plan.startswith(("tp", "pp")))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2, 4])
def test_encoders_on_7_tokens_match_one_process(cp):
    """Non-causal attention (padded keys hidden by the ring's limit), a mean pool over the
    sequence (gathered without the padding), a per-token mean loss over elements (scaled to the
    real count), a causal one (the padded keys after every real query). At cp=4 rank 0's second
    block is all padding."""
    got = launch(uneven_parity, cp, FORMS, f"cp={cp}", 3, timeout=850)
    _check(got, FORMS)


SHIFTS = ["shift@7", "selfshift:ce@15", "selfshift:sum@15", "exactgpt@7", "embeds", "merged@7"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shifts_and_exact_tables_on_uneven_lengths_match_one_process_under_cp2():
    """A look-ahead shift near the real end reads zeros, not the padding (a drop_tail after its
    halo); a shift inside the model (logits[:, :-1] against x[:, 1:]) on 15 tokens: its tail
    is the shift's plus the padding. A GPT whose tables hold exactly the real length (its
    position table read at clamped positions, its causal-mask buffer read at 7, not 8).
    Embeddings [4, 7, 16] (the sequence found by compiling). A softmax over every token of the
    batch ([b*t] merged: gathered through its digits, the padding left out)."""
    got = launch(uneven_parity, 2, SHIFTS, "cp=2", 3, timeout=850)
    _check(got, SHIFTS)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_batch_norm_over_every_token_on_7_tokens_matches_one_process_under_cp2():
    """BatchNorm1d over the merged [b*t] tokens: its statistics over the real tokens only. The
    bias before it has a zero gradient in exact arithmetic (the norm removes it): its rounding
    noise is 6.4e-5 of the largest gradient at 8 tokens as at 7, hence the tolerance."""
    got = launch(uneven_parity, 2, ["zoo:hw_batchnorm@7"], "cp=2", 3, timeout=550)
    _check(got, ["zoo:hw_batchnorm@7"], grad_tol=2e-4)


ZOO_ENCODERS = ["zoo:bert_mlm@7", "zoo:nn_encoder_seq_first@7", "zoo:t5@7", "zoo:nn_multihead_attention@7",
                "zoo:nn_decoder@7"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zoo_encoders_on_7_tokens_match_one_process_under_cp2():
    """HF BERT (masked LM, an attention mask input padded with hidden keys besides the ring's
    limit), nn.TransformerEncoder seq-first ([S, B]: padded along dim 0), T5 (a non-causal
    encoder with learned relative buckets, a causal decoder, cross-attention to padded keys),
    nn.MultiheadAttention and nn.TransformerDecoder."""
    got = launch(uneven_parity, 2, ZOO_ENCODERS, "cp=2", 3, timeout=850)
    _check(got, ZOO_ENCODERS)


def test_a_padded_key_would_change_a_non_causal_result():
    """The regression the ring's limit guards: the same non-causal attention over the padded
    sequence with the padded key visible differs from one process on the real 7 tokens, and
    with it hidden matches (a ring of one, the whole padded sequence as its block)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    real = torch.nn.functional.scaled_dot_product_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :])
    hidden = cp_ops.ring_attention(q, k, v, 0.5, False, None, limit=7)[..., :7, :]
    seen = cp_ops.ring_attention(q, k, v, 0.5, False, None)[..., :7, :]
    assert (hidden - real).abs().max() < 1e-12
    assert (seen - real).abs().max() > 1e-3


def test_the_encoder_hides_the_padded_keys_in_its_ring():
    """Non-causal: `limit=7` (the real length); causal: none, its mask hides them already."""
    from threefold.codegen.artifact import build_sources

    def ring_call(form):
        code = build_sources(compile_workload(encoder_workload(form), "cp=2"))["chunk00.py"]
        return code.split("cp_ops.ring_attention(")[1].split(")  #")[0].split("\n        ")[0:3]
    assert any("limit=7" in line for line in ring_call("tokens"))
    assert not any("limit=" in line for line in ring_call("causal"))


def test_an_uneven_sequence_beside_a_feature_dim_that_divides_is_found_by_compiling():
    """[4, 7, 16] embeddings at cp=2: dim 2 (16) divides 2*cp, dim 1 (7) does not; before, the
    features were cut and the trace failed at the linear layer. Both are tried, the padded
    sequence compiles."""
    prog = compile_workload(workload("embeds"), "cp=2")
    assert prog.seq_tail == 1
    assert any("sequence is dim 1, the only one of its candidates [2, 1]" in n for n in prog.notes), prog.notes


REFUSALS = {
    "denominator": "the loss's denominator is counted on the whole unpadded sequences of an uneven length and "
                   "cannot run there",
    "shortened_mean": "a mean over its elements, whose number was traced at this rank's shortened length",
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_what_stays_refused_on_a_padded_sequence_says_why_in_one_line(kind):
    from tests.cp_uneven_models import refused
    with pytest.raises(threefold.PlanError, match=REFUSALS[kind].replace("(", r"\(").replace(")", r"\)")) as err:
        compile_workload(refused(kind), "cp=2")
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,compiled,length", [("zoo:gpt_seq7", 7, 6), ("zoo:llama", 8, 7)])
def test_a_step_on_another_length_than_compiled_is_named_not_padded_silently(arch, compiled, length):
    """7 and 6 tokens both pad to 8 at cp=2: the code leaves 1 position out, so 6 would train
    wrong; 7 tokens on code compiled for 8 would pad to 8 and leave nothing out."""
    from tests.cp_uneven_models import wrong_length
    for got in launch(wrong_length, 2, "cp=2", arch, length, timeout=250):
        assert f"has {length} positions (dim 1), but the artifact was compiled for {compiled}" in got, got
