"""Context parallelism, the wider matrix (marker zoo: `pytest -m zoo tests/test_context_parallel_zoo.py`):
cp=4, cp with dp / pp / recompute, Hugging Face Llama with sdpa attention, ring attention on 4 ranks."""
import pytest

from threefold.runtime.launch import launch
from tests.cp_jobs import ring_checks
from tests.test_context_parallel import GPT, LLAMA, _check

LLAMA_SDPA = (LLAMA[0], {**LLAMA[1], "attn": "sdpa"})


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_with_recompute_and_hf_sdpa():
    _check(2, [LLAMA_SDPA + ("cp=2",), GPT + ("cp=2,recompute=full",), LLAMA + ("cp=2,recompute=selective",)])


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cp4_and_cp2_with_dp_or_pp():
    # batch 2: HF's mask indexes the batch with an arange too, and at batch 4 its length would
    # equal the local sequence length 16/4 (a coincidence the mask check refuses in one line)
    llama_b2 = (LLAMA[0], {**LLAMA[1], "batch": 2})
    _check(4, [GPT + ("cp=4",), llama_b2 + ("cp=4",), GPT + ("cp=2,dp=2",), LLAMA + ("cp=2,pp=2,m=2",),
               LLAMA_SDPA + ("cp=2,tp=2",)])


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ring_attention_on_four_ranks():
    for rank in launch(ring_checks, 4, 4, timeout=250):
        for diffs in rank:
            assert max(diffs.values()) < 1e-12, diffs


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_saved_under_cp_loads_under_tp(tmp_path):
    """cp changes nothing in the saved layout: 3 AdamW steps at cp=2, save, load at tp=2, 3 more
    steps = 6 single-process steps (and the other way round)."""
    from tests.test_checkpoint_reshard import GPT as CK_GPT, reference, run_phases
    phases = [("A", "cp2-tp2", CK_GPT, "cp=2"), ("A", "tp2-cp2", CK_GPT, "tp=2"),
              ("B", "cp2-tp2", CK_GPT, "tp=2"), ("B", "tp2-cp2", CK_GPT, "cp=2")]
    losses = launch(run_phases, 2, phases, str(tmp_path), timeout=550)[0]
    ref = reference(CK_GPT)
    for name in ("cp2-tp2", "tp2-cp2"):
        got = losses[("A", name)] + losses[("B", name)]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5, (name, got, ref)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp_ranks_draw_their_own_dropout_masks():
    """cp ranks hold different tokens: their random ops are seeded apart, as dp ranks' are."""
    from tests.cp_jobs import dropout_seeds
    keys = launch(dropout_seeds, 2, "cp=2", timeout=250)
    assert keys[0] != keys[1], keys


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_causal_conv1d_model_matches_one_process():
    """A Mamba-style causal conv over time: halos exchanged between the blocks' ranks."""
    from tests.cp_jobs import conv_parity
    from tests.parity import max_rel_diff, sgd_losses
    from tests.test_context_parallel import causal_conv_workload
    ref = sgd_losses(causal_conv_workload(), 3)
    for cp in (2, 4):
        for losses in launch(conv_parity, cp, cp, timeout=280):
            assert max_rel_diff(losses, ref) < 1e-5, (cp, losses, ref)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_masked_mean_loss_counts_tokens_globally():
    """ignore_index on positions 4-10, all in cp rank 1's blocks: the ranks count different
    numbers of tokens, and the loss is still the single-process masked mean."""
    from tests.cp_jobs import ignore_index_parity, ignore_index_workload
    from tests.parity import max_rel_diff, sgd_losses
    ref = sgd_losses(ignore_index_workload(), 3)
    for losses in launch(ignore_index_parity, 2, "cp=2", timeout=350):
        assert max_rel_diff(losses, ref) < 1e-5, (losses, ref)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_decoders_at_cp2():
    """Qwen2, Mistral, GPT-NeoX (partial rotary), Phi (parallel attention/MLP), Gemma (examples/hf.py
    causal_lm), eager attention with HF's own mask graphs."""
    _check(2, [("causal_lm", {"arch": a, "seq": 16}, "cp=2") for a in ("qwen2", "mistral", "gpt_neox", "phi", "gemma")])


def test_opt_learned_positions_from_a_cumsum_carry_the_blocks_before():
    """OPT numbers positions by a cumsum over a ones mask made in forward (not an arange): the
    mask is the whole-length one cut to this rank's blocks (passes/cp_factories.py), and the
    cumsum carries the totals of the blocks before each of this rank's (runtime/cp_scan.py;
    was the all-gather fallback, before that a refusal: "varies per position"; parity:
    tests/test_cp_factories.py)."""
    from examples.hf import causal_lm
    from threefold.codegen.artifact import build_sources
    from threefold.compiler.api import compile_workload
    prog = compile_workload(causal_lm(arch="opt", seq=16), "cp=2,strict=true")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes
    assert build_sources(prog)["chunk00.py"].split("def model_outputs")[0].count("cp_scan.scan_seq(") == 1


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cp2_with_zero1_and_zero2():
    """ZeRO-1/2 shards are summed over the cp ranks too (zero=3 is in the default file)."""
    _check(4, [GPT + ("cp=2,dp=2,zero=1",), LLAMA + ("cp=2,dp=2,zero=2",)])


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_masks_and_all_gather_fallback_at_cp4():
    """Padding, ALiBi and sliding-window masks, and the all-gather fallback, on a ring of 4."""
    from tests.cp_jobs import mask_parity, mixing_parity
    from tests.cp_mask_models import masked_workload, mixing_workload
    from tests.parity import max_rel_diff, sgd_losses
    masks, mixing = ["pad_sdpa", "pad_hand", "alibi", "window"], ["cumsum", "cummax", "conv", "pool"]
    for job, modes, make in ((mask_parity, masks, masked_workload), (mixing_parity, mixing, mixing_workload)):
        got = launch(job, 4, modes, "cp=4", 3, timeout=550)
        for i, mode in enumerate(modes):
            ref = sgd_losses(make(mode), 3)
            for rank in got:
                assert max_rel_diff(rank[i], ref) < 1e-5, (mode, rank[i], ref)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_in_bf16_matches_single_process_autocast_within_rounding_noise():
    """bf16 under cp: ring attention's online softmax in 16-bit stays within the rounding noise
    of one process's autocast run (the criterion tests/test_precision.py uses for tp, pp, dp)."""
    import math
    from tests.test_precision import GPT as P_GPT, STEPS, parallel, reference, rounding_noise
    import torch
    ref = reference("gpt", P_GPT, STEPS, "sgd", torch.bfloat16)
    fp32 = reference("gpt", P_GPT, STEPS, "sgd")
    sigma = rounding_noise("gpt", P_GPT, STEPS, "sgd", torch.bfloat16, draws=6)
    tol = [4 * math.sqrt(2) * s for s in sigma]
    results = launch(parallel, 2, ["cp=2,dtype=bf16"], "gpt", P_GPT, STEPS, "sgd",
                     timeout=500)
    for r in results[0]:
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref)]
        assert all(d <= t for d, t in zip(diffs, tol)), (r["plan"], diffs, tol)
        assert r["losses"] != fp32, r["plan"]


# Causal LMs of the zoo that cp=2 splits position-wise since the op registry (issue 40): GPT-2's
# [b*s, h] views, rotary tables sliced or indexed at position ids (GPT-J, CodeGen, Meta's LLaMA),
# GQA by repeat / repeat_interleave (Cohere, GLM), einsum projections, empty KV caches, a
# learned position table sliced to T (nn.MultiheadAttention LM); MoEs whose routing sort
# orders each rank's own token rows (Mixtral, OLMoE, a handwritten top-2 with index_add);
# DeepSeek-V3's key buffer filled by slices (new_empty + copy_), BERT's token types gathered
# at position ids, BatchNorm over merged tokens (all-gather through its digits), GPT-Neo's
# where(mask, scores, finfo.min), a mask built and never read (Qwen2-MoE), XGLM's [b*h] score
# views and finfo.min floor, Bloom's baddbmm with ALiBi of key positions; batch 2
# (tests/cp_jobs.zoo_batch2).
CP_ZOO = ["mixtral", "olmoe", "hw_moe_top2", "deepseek_v3", "bert_mlm", "hw_batchnorm", "gpt_neo", "qwen2_moe", "xglm", "bloom",
          "gpt2", "gptj", "codegen", "cohere", "glm", "nn_multihead_attention", "nn_decoder",
          "hw_gqa_repeat_interleave", "hw_flat_mlp", "hw_einsum", "llama_cache", "qwen2_cache", "meta_llama",
          "falcon", "llama", "qwen2", "gemma", "phi3", "nn_encoder_seq_first", "llama4_text"]


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sliding_windows_and_soft_capping_at_seq16_match_one_process():
    """Sliding windows of 4 at seq 16,
    Gemma 2's logit soft-capping and gpt-oss's attention sinks in the ring, at seq 16."""
    from tests.cp_jobs import zoo_batch2, zoo_parity
    from tests.parity import max_rel_diff, sgd_losses
    archs = ["gemma2", "mistral", "cohere2", "gpt_oss"]
    got = launch(zoo_parity, 2, archs, "cp=2", 3, 16, timeout=850)
    for arch in archs:
        ref = sgd_losses(zoo_batch2(arch, 16), 3)
        for rank in got:
            assert not isinstance(rank[arch], str), (arch, rank[arch])
            assert max_rel_diff(rank[arch], ref) < 1e-5, (arch, rank[arch], ref)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sizes_equal_to_the_local_length_match_one_process():
    """The zoo's own batch (4 rows of 8 tokens): at cp=2 the batch and Mistral's and Gemma 2's
    sliding windows of 4 equal the local length 4; masks read from the model traced at 8."""
    from tests.cp_jobs import zoo_batch2, zoo_parity
    from tests.parity import max_rel_diff, sgd_losses
    archs = ["mistral", "gemma2", "llama"]
    got = launch(zoo_parity, 2, archs, "cp=2", 3, 8, 4, timeout=850)
    for arch in archs:
        ref = sgd_losses(zoo_batch2(arch, 8, 4), 3)
        for rank in got:
            assert not isinstance(rank[arch], str), (arch, rank[arch])
            assert max_rel_diff(rank[arch], ref) < 1e-5, (arch, rank[arch], ref)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_zoo_causal_lms_at_cp2_match_one_process():
    from tests.cp_jobs import zoo_batch2, zoo_parity
    from tests.parity import max_rel_diff, sgd_losses
    got = launch(zoo_parity, 2, CP_ZOO, "cp=2", 3, timeout=2300)
    for arch in CP_ZOO:
        ref = sgd_losses(zoo_batch2(arch), 3)
        for rank in got:
            assert not isinstance(rank[arch], str), (arch, rank[arch])
            assert max_rel_diff(rank[arch], ref) < 1e-5, (arch, rank[arch], ref)
