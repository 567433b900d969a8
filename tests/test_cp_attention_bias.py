"""Attention with a learned relative-position bias (T5) under cp: the bias's subgraph, found by
data flow between the aranges and the add to the scores, is evaluated per ring step at this
rank's global query positions and the visiting keys' positions (passes/cp_attention_bias.py,
runtime/cp_bias.py); its gradient reaches the bias table through each step's block."""
import pytest
import torch

import threefold
from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_bias_jobs import relbias_parity, ring_bias_vs_full
from tests.cp_bias_models import RelBiasLM, one_process, relbias_workload
from tests.parity import max_rel_diff

MODES = ["bi_pad", "causal"]   # tests/cp_bias_models.RelBiasLM


def _ring_calls(w) -> list[str]:
    code = build_sources(compile_workload(w, "cp=2"))["chunk00.py"].split("def model_outputs")[0]
    out, i = [], code.find("cp_ops.ring_attention(")
    while i >= 0:
        out.append(code[i:code.index(")\n", i)])
        i = code.find("cp_ops.ring_attention(", i + 1)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_the_shared_bias_becomes_one_block_per_ring_step(mode):
    """Both layers read the same blocks (computed once, as the model computes the bias once);
    the padding stays a key-side bias and the causal mask the ring's own (blocks skipped)."""
    w = relbias_workload(mode)
    code = build_sources(compile_workload(w, "cp=2"))["chunk00.py"].split("def model_outputs")[0]
    calls = _ring_calls(w)
    assert len(calls) == 2 and all("pbias=[" in c for c in calls), calls
    assert calls[0].split("pbias=")[1].split("]")[0] == calls[1].split("pbias=")[1].split("]")[0]
    assert code.count("cp_bias.ring_positions(") == 3   # the queries', and the keys' at steps 0 and 1
    assert all(("kbias=" in c) == (mode == "bi_pad") for c in calls)
    assert all((", True, self.cp_group" in c) == (mode == "causal") for c in calls)


class _LengthScaled(RelBiasLM):
    """A bias scaled by the sequence length (`how` "div": / t, "last": * (i[-1] + 1)), or
    multiplied by tril(ones(t, t)): not what copying its aranges per block can give."""

    def __init__(self, how: str):
        super().__init__("causal")
        self.how = how

    def forward(self, idx, attention_mask=None):
        b, t = idx.shape
        x = self.emb(idx)
        i = torch.arange(t)
        bias = self.rel(self.bucket(i[None, :] - i[:, None])).permute(2, 0, 1).unsqueeze(0)
        if self.how == "tril":   # a position-dependent constant that is not an arange
            bias = bias * torch.tril(torch.ones(t, t))
        else:
            bias = bias / t if self.how == "div" else bias * (i[-1:] + 1).float()
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = torch.softmax(q @ k.transpose(-2, -1) + bias, -1) @ v
            x = x + proj(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


@pytest.mark.parametrize("how,words,seq", [("div", "depends on the length", 16), ("last", "query and key positions", 16),
                                           ("div", "depends on the length", 64), ("tril", "query and key positions", 16)])
def test_a_bias_that_depends_on_the_length_is_refused(how, words, seq, monkeypatch):
    """seq 64 with a small budget: the bias is read at a shorter local length (as at long
    sequences, where reading it whole at compile time would cost too much)."""
    import threefold.passes.cp_attention_bias as pb
    monkeypatch.setattr(pb, "_WHOLE_CHECK", 2000 if seq == 64 else pb._WHOLE_CHECK)
    w = relbias_workload("causal", seq=seq)
    torch.manual_seed(0)
    w["model"] = _LengthScaled(how)
    with pytest.raises(threefold.PlanError, match=words) as err:
        compile_workload(w, "cp=2")
    assert "\n" not in str(err.value) and "cp=1" in str(err.value)


def test_each_layer_its_own_bias_through_sdpa():
    calls = _ring_calls(relbias_workload("sdpa"))
    blocks = [c.split("pbias=")[1].split("]")[0] for c in calls]
    assert len(calls) == 2 and blocks[0] != blocks[1] and all(b.count(",") == 1 for b in blocks), calls


def test_a_long_sequence_reads_the_bias_at_a_shorter_length(monkeypatch):
    import threefold.passes.cp_attention_bias as pb
    monkeypatch.setattr(pb, "_WHOLE_CHECK", 2000)
    seen = []
    real = pb._check
    monkeypatch.setattr(pb, "_check", lambda bias, stage, n, m, *a: (seen.append((n, m)), real(bias, stage, n, m, *a)))
    assert len(_ring_calls(relbias_workload("bi_pad", seq=64))) == 2
    assert seen and all(n == 32 and m < 32 for n, m in seen), seen


def test_ring_attention_adds_one_bias_block_and_returns_its_gradient():
    """One rank (group None): pbias [step 0] is added to the scores, its gradient is ds."""
    from threefold.runtime.cp_ops import ring_attention
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = ring_attention(q, k, v, 0.5, True, None, pbias=[bias])
    s = (q @ k.transpose(-2, -1) * 0.5 + bias).masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1),
                                                            float("-inf"))
    ref = torch.softmax(s, -1) @ v
    assert torch.allclose(out, ref, atol=1e-10)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, bias))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v, bias))
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ring_with_a_position_bias_equals_full_attention_cp2():
    for rank in launch(_ring_cases, 2, timeout=250):
        for diffs in rank:   # float64: exact up to rounding
            assert diffs["dtable_norm"] > 1e-3, diffs   # the table's gradient is not trivially 0
            assert max(v for k, v in diffs.items() if k != "dtable_norm") < 1e-12, diffs


def _ring_cases():
    return [ring_bias_vs_full(2, True), ring_bias_vs_full(2, False, seed=1)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_t5_style_relative_bias_cp2_matches_one_process():
    """Losses and every parameter's gradient (the bias table included) over 3 SGD steps, fp32."""
    modes = MODES + ["sdpa"]
    got = launch(relbias_parity, 2, modes, "cp=2", 3, timeout=550)
    for i, mode in enumerate(modes):
        ref_losses, ref_grads = one_process(mode, 3)
        for losses, grads in (rank[i] for rank in got):
            assert max_rel_diff(losses, ref_losses) < 1e-5, (mode, losses, ref_losses)
            for step, (a, b) in enumerate(zip(grads, ref_grads)):
                assert set(a) == set(b), (mode, sorted(a), sorted(b))
                for name in b:
                    scale = b[name].abs().max().item()
                    assert scale > 0 and (a[name] - b[name]).abs().max().item() <= 1e-5 * scale + 1e-7, \
                        (mode, step, name)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["tp=2,cp=2", "cp=4"])
def test_t5_style_relative_bias_on_four_ranks_matches_one_process(plan):
    """tp shards the heads of the bias table; cp=4 meets three other key blocks."""
    got = launch(relbias_parity, 4, MODES, plan, 3, timeout=550)
    for i, mode in enumerate(MODES):
        ref_losses, _ = one_process(mode, 3)
        for losses, _ in (rank[i] for rank in got):
            assert max_rel_diff(losses, ref_losses) < 1e-5, (mode, plan, losses, ref_losses)
