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
    _check(4, [GPT + ("cp=4",), LLAMA + ("cp=4",), GPT + ("cp=2,dp=2",), LLAMA + ("cp=2,pp=2,m=2",),
               LLAMA_SDPA + ("cp=2,tp=2",)])


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ring_attention_on_four_ranks():
    for rank in launch(ring_checks, 4, 4, timeout=250):
        for diffs in rank:
            assert max(diffs.values()) < 1e-12, diffs
