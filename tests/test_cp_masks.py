"""Ring attention with masks (cp=N): padding from an input, ALiBi biases, sliding windows.

Compile-level checks that each mask becomes what the ring recomputes per step (a key-side
bias that travels with K/V, or a relative-position band and slope), the refusals for masks
the ring cannot recompute, and parity with one process at cp=2 (fp32, 3 SGD steps)."""
import pytest
import torch
import torch.nn.functional as F

import threefold
from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_jobs import mask_parity
from tests.cp_mask_models import MaskedAttention, hf_llama_padded, masked_workload
from tests.parity import max_rel_diff, sgd_losses

MODES = ["pad_sdpa", "pad_hand", "alibi", "window", "half", "pad_query"]


def _ring_call(mode: str) -> str:
    code = build_sources(compile_workload(masked_workload(mode), "cp=2"))["chunk00.py"]
    code = code.split("def model_outputs")[0]
    i = code.index("cp_ops.ring_attention(")
    return code[i:code.index(")\n", i)]


@pytest.mark.parametrize("mode,words", [
    ("pad_sdpa", "kbias=key_bias"),
    ("pad_hand", "kbias=key_bias"),
    ("alibi", "rel=(None, 0, [0.5, 0.25], [0.0, 0.0], (2,))"),
    ("window", "rel=(-5, 0, [0.0], [0.0], ())"),
    # a window of t // 2 at 16 positions is 8 (d = j - i >= -7); read from this rank's trace at
    # 8 positions it was the number 4, and cp trained a window of 4 silently
    ("half", "rel=(-7, 0, [0.0], [0.0], ())"),
])
def test_masks_become_what_the_ring_recomputes(mode, words):
    call = _ring_call(mode)
    assert words in call and ", True, self.cp_group" in call, call   # all causal: blocks skipped


class _Document(MaskedAttention):
    """A block-diagonal (document) mask from a buffer: not a function of j - i."""

    def forward(self, idx, attention_mask=None):
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(t)
        keep = (i[None, :] // 4) == (i[:, None] // 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))


def test_sdpa_masks_the_ring_cannot_carry_run_on_the_gathered_sequence():
    """A padding mask over queries (or one computed from parameters, Doge's) is no key-side
    bias: SDPA takes the all-gather fallback instead of a refusal (parity: MODES below)."""
    prog = compile_workload(masked_workload("pad_query"), "cp=2")
    assert [n for n in prog.notes if n.startswith("cp fallback: scaled_dot_product_attention")]
    with pytest.raises(threefold.PlanError, match="strict plan"):
        compile_workload(masked_workload("pad_query"), "cp=2,strict=true")


@pytest.mark.parametrize("cls,words", [(_Document, "not a band")])
def test_masks_the_ring_cannot_recompute_are_refused(cls, words):
    w = masked_workload("pad_sdpa")
    torch.manual_seed(0)
    w["model"] = cls("pad_sdpa")
    with pytest.raises(threefold.PlanError, match=words) as err:
        compile_workload(w, "cp=2")
    assert "\n" not in str(err.value) and "cp=1" in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_masked_attention_cp2_matches_one_process():
    got = launch(mask_parity, 2, MODES, "cp=2", 3, timeout=550)
    for i, mode in enumerate(MODES):
        ref = sgd_losses(masked_workload(mode), 3)
        for rank in got:
            assert max_rel_diff(rank[i], ref) < 1e-5, (mode, rank[i], ref)


def test_hf_llama_padding_mask_travels_with_the_keys():
    """HF builds mask[batch_idx, kv_idx] & causal: the causal part is the ring's, the padding a
    key-side bias; kv_idx stays this rank's local arange (the input holds its positions)."""
    code = build_sources(compile_workload(hf_llama_padded("sdpa"), "cp=2"))["chunk00.py"]
    code = code.split("def model_outputs")[0]
    assert code.count("kbias=") == 2 and code.count("cp_ops.key_bias(") == 2 and "rel=" not in code


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_llama_with_attention_mask_cp2_matches_one_process():
    modes = ["hf_eager", "hf_sdpa"]
    got = launch(mask_parity, 2, modes, "cp=2", 3, timeout=550)
    for i, mode in enumerate(modes):
        ref = sgd_losses(hf_llama_padded(mode[3:]), 3)
        for rank in got:
            assert max_rel_diff(rank[i], ref) < 1e-5, (mode, rank[i], ref)


class _SplitHeads(torch.nn.Module):
    """ALiBi with separate q/k/v projections, so tp shards the heads and slices the bias."""

    def __init__(self, heads=2, width=16, vocab=32):
        super().__init__()
        self.heads = heads
        self.emb, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width) for _ in range(4))
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]))

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = (m(x).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        i = torch.arange(t)
        s = q @ k.transpose(-2, -1) * 0.35 + self.slopes[:, None, None] * (i[None, :] - i[:, None]).float()
        s = s.masked_fill(~(i[None, :] <= i[:, None]), float("-inf"))
        y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.head(x + self.o(y))


def test_a_per_head_bias_sliced_over_tp_is_refused_not_guessed():
    """One compile-time value cannot stand for every tp rank's slice of the heads."""
    w = masked_workload("alibi")
    torch.manual_seed(0)
    w["model"] = _SplitHeads()
    assert "rel=(None, 0, [0.5, 0.25]" in build_sources(compile_workload(w, "cp=2"))["chunk00.py"]
    with pytest.raises(threefold.PlanError, match="split over tp ranks") as err:
        compile_workload(w, "cp=2,tp=2")
    assert "\n" not in str(err.value)


def test_alibi_of_key_positions_fits_as_relative_per_query():
    """Bloom's ALiBi is slope * j (key positions only): per query it differs from slope * (j - i)
    by a constant the softmax does not see, so it fits with that slope; a bias that varies
    otherwise per query is still refused."""
    import threefold
    from threefold.passes.cp_masks import _fit
    s = 8
    j = torch.arange(s, dtype=torch.float64)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    slopes = [0.5, 0.25]
    m = torch.stack([(sl * j).expand(s, s).masked_fill(causal, float("-inf")) for sl in slopes])
    lo, hi, got, _ = _fit(m, "attention")
    assert (lo, hi) == (None, 0) and got == slopes
    odd = (j[:, None] * j[None, :]).masked_fill(causal, float("-inf"))[None]
    with pytest.raises(threefold.PlanError, match="not slope"):
        _fit(odd, "attention")


def test_ring_attention_soft_caps_scores_forward_and_backward():
    """Gemma 2's logit soft-capping, cap * tanh(s / cap) before the mask, in the ring's own
    forward and hand-written backward (one rank: the same code every step runs)."""
    from threefold.runtime.cp_ops import ring_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cap, scale = 2.0, 0.9
    out = ring_attention(q, k, v, scale, True, None, softcap=cap)
    s = torch.tanh(q @ k.transpose(-2, -1) * scale / cap) * cap
    s = s.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf"))
    ref = torch.softmax(s, -1) @ v
    assert torch.allclose(out, ref, atol=1e-10)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want))


def test_ring_attention_with_a_sink_logit_forward_and_backward():
    """Attention sinks (gpt-oss): one more key per query with a learned logit and a zero value,
    merged after the ring; the sink's gradient too."""
    from threefold.runtime.cp_ops import ring_attention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    sink = sinks.reshape(1, 3, 1, 1).expand(2, 3, 8, 1)
    out = ring_attention(q, k, v, 0.7, True, None, sink=sink)
    s = (q @ k.transpose(-2, -1) * 0.7).masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf"))
    ref = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1] @ v
    assert torch.allclose(out, ref, atol=1e-10)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want))
