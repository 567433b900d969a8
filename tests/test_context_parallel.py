"""Context parallelism (plan cp=N): the plan and mesh, the compiler's rewrite and its refusals,
ring attention against full attention, and parity with one process (fp32, 3 SGD steps).

The multi-rank cases here are the representative few; tests/test_context_parallel_zoo.py
(marker zoo) runs the wider matrix (cp=4, cp x dp, cp x pp, recompute, HF sdpa).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import threefold
from threefold.compiler.api import compile_workload
from threefold.codegen.artifact import build_sources
from threefold.plan import Plan
from threefold.runtime.cp_ops import block_positions, local_blocks
from threefold.runtime.launch import launch
from threefold.runtime.mesh import Mesh
from tests.cp_jobs import parity_cases, ring_checks
from tests.parity import load_workload, max_rel_diff, sgd_losses

STEPS = 3
GPT = ("gpt", {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 16, "batch": 4})
LLAMA = ("llama", {"n_layer": 2, "hidden": 32, "n_head": 4, "n_kv_head": 2, "intermediate": 64,
                   "seq": 16, "batch": 4})


def test_plan_and_mesh_place_cp_between_dp_and_tp():
    plan = Plan.parse("tp=2,cp=2,dp=2")
    assert Plan.parse(str(plan)) == plan and plan.world_size == 8 and "cp=2" in str(plan)
    mesh = plan.mesh
    assert [n for n, _ in mesh.axes] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    for r in range(8):
        c = mesh.coord(r)
        assert r == c.tp + 2 * (c.cp + 2 * c.dp)
    assert mesh.group(0, "cp") == [0, 2] and mesh.group(0, "dp+cp") == [0, 2, 4, 6]
    assert Mesh(tp=2).cp == 1


@pytest.mark.parametrize("text,words", [("cp=2,tp=2,sp=true", "sp=true"), ("cp=0", "positive")])
def test_plan_refuses_what_cp_does_not_support(text, words):
    with pytest.raises(threefold.PlanError, match=words):
        Plan.parse(text)


def test_load_balanced_blocks_and_positions():
    t = torch.arange(16)
    assert local_blocks(t, 0, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_blocks(t, 0, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (2, 4):
        held = torch.cat([block_positions(16 // cp, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(16))
        assert all(torch.equal(block_positions(16 // cp, cp, r), local_blocks(t, 0, cp, r)) for r in range(cp))


@pytest.mark.parametrize("factory,kwargs", [GPT, LLAMA])
def test_attention_becomes_a_ring_and_positions_global(factory, kwargs):
    prog = compile_workload(load_workload(factory, **kwargs), "cp=2")
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]   # forward only
    assert code.count("cp_ops.ring_attention(") == 2          # one per layer
    assert "cp_ops.positions(8, self.cp_group" in code         # arange(8) -> global positions
    assert "softmax" not in code and "masked_fill" not in code and "cumsum" not in code
    # each input's sequence dim is its cp placement, which the manifest's inputs carry
    assert [b.on_mesh.dim("cp") for b in prog.user_inputs] == [1, 1] and prog.seq_len == 8


class _Emb(nn.Module):
    """Embedding -> op(x) -> head: `op` is what the test checks."""

    def __init__(self, op, vocab=32, width=8):
        super().__init__()
        self.emb, self.head, self.op = nn.Embedding(vocab, width), nn.Linear(width, vocab), op
        self.register_buffer("table", torch.randn(64, width))
        self.conv = nn.Conv1d(width, width, 3, padding=2)                    # causal after [..., :T]
        self.same = nn.Conv1d(width, width, 3, padding=1)                    # sees the next position too

    def forward(self, idx, *rest):
        return self.head(self.op(self, self.emb(idx), *rest))


def _lm(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _sdpa_padding(m, x, pad):
    """A padding mask over queries: the ring carries key-side masks only, so SDPA takes the
    all-gather fallback (tests/test_cp_masks.py), an error under strict=true."""
    q = x.unsqueeze(1)
    return F.scaled_dot_product_attention(q, q, q, attn_mask=pad[:, None, :, None].bool()).squeeze(1)


@pytest.mark.parametrize("op,words", [
    # (a cumsum over the sequence carries its blocks' totals, exact under strict: test_cp_scans.py)
    (lambda m, x: torch.cummax(x, dim=1).values, "cummax at <top> mixes sequence positions"),
    # a table sliced to T reads this rank's rows now (tests/test_cp_rules.py); values made per
    # position some other way (linspace over the traced length) still cannot be moved
    (lambda m, x: x + torch.linspace(0, 1, x.shape[1])[:, None], "varies per position"),
    (lambda m, x: m.same(x.transpose(1, 2)).transpose(1, 2), "conv1d at same mixes sequence positions"),
    # (a sum or mean over the sequence is partial sums all-reduced: cp_gather.reduce_seq)
    (lambda m, x: x - x.var(dim=1, keepdim=True), "var at <top> mixes sequence positions"),
    (_sdpa_padding, "scaled_dot_product_attention at <top> mixes sequence positions"),
])
def test_ops_that_mix_positions_are_refused_in_one_line(op, words):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (2, 9), generator=g)
    inputs = (idx[:, :-1],) + ((torch.ones(2, 8),) if op is _sdpa_padding else ())
    w = {"model": _Emb(op), "inputs": inputs, "target": idx[:, 1:], "loss_fn": _lm}
    with pytest.raises(threefold.PlanError, match=words) as err:   # strict: no all-gather fallback
        compile_workload(w, "cp=2,strict=true")
    assert "\n" not in str(err.value) and "cp=1" in str(err.value)


def _window_attention(m, x, window=10):
    """Attention over a sliding window of 10 positions, mask built from aranges: causal at
    the traced length 8 (cp=2 of 16), a window over the whole 16."""
    i = torch.arange(x.shape[1])
    hidden = ~((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window))
    s = (x @ x.transpose(1, 2)).masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ x


def test_sliding_window_wider_than_a_rank_share_is_a_band_over_the_whole_sequence():
    idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(0))
    w = {"model": _Emb(_window_attention), "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": _lm}
    code = build_sources(compile_workload(w, "cp=2"))["chunk00.py"]   # causal at s/cp, a window at s
    assert "rel=(-9, 0, [0.0], [0.0], ())" in code
    w["model"] = _Emb(lambda m, x: _window_attention(m, x, window=64))   # wider than s: causal
    code = build_sources(compile_workload(w, "cp=2"))["chunk00.py"]
    assert "ring_attention" in code and "rel=" not in code


def _causal_conv(m, x):
    """A Mamba-style causal depthwise-free conv over time: conv1d(padding=k-1)[..., :T]."""
    return x + m.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def causal_conv_workload(seq: int = 16):
    torch.manual_seed(0)
    idx = torch.randint(0, 32, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    return {"model": _Emb(_causal_conv), "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": _lm}


def test_causal_conv1d_exchanges_halos():
    prog = compile_workload(causal_conv_workload(), "cp=2")
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert "cp_ops.causal_conv1d(" in code and "conv1d.default" not in code


def test_sequence_not_divisible_by_2cp_is_padded():
    """Was refused ("use a sequence length that is a multiple of 8"): padded to 16 positions
    (passes/cp_padding.py; parity in tests/test_cp_uneven.py)."""
    prog = compile_workload(load_workload("gpt", **{**GPT[1], "seq": 12}), "cp=4")
    assert prog.seq_tail == 4 and prog.seq_len == 4 and "padded to 16" in prog.notes[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ring_attention_equals_full_attention_forward_and_backward():
    for rank in launch(ring_checks, 2, 2, timeout=250):
        for diffs in rank:   # float64: exact up to rounding
            assert max(diffs.values()) < 1e-12, diffs


def _check(world, cases):
    got = launch(parity_cases, world, cases, STEPS, timeout=550)
    for i, (factory, kwargs, plan) in enumerate(cases):
        ref = sgd_losses(load_workload(factory, **kwargs), STEPS)
        for rank in got:
            assert max_rel_diff(rank[i], ref) < 1e-5, (factory, plan, rank[i], ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_matches_one_process_on_gpt_and_llama():
    _check(2, [GPT + ("cp=2",), LLAMA + ("cp=2",)])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_with_dp2_zero3_matches_one_process():
    """ZeRO's shards are reduced over the cp ranks too (they hold the same rows)."""
    _check(4, [GPT + ("cp=2,dp=2,zero=3",)])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gradient_norm_under_cp_counts_each_parameter_once():
    from tests.cp_jobs import grad_norm_after_one_step
    w = load_workload(*GPT[:1], **GPT[1])
    w["loss_fn"](w["model"](*w["inputs"]), w["target"]).backward()
    ref = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in w["model"].parameters() if p.grad is not None))
    for norm in launch(grad_norm_after_one_step, 2, GPT[0], GPT[1], "cp=2", timeout=250):
        assert abs(norm - ref.item()) / ref.item() < 1e-5, (norm, ref.item())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_with_tp2_matches_one_process():
    _check(4, [GPT + ("cp=2,tp=2",)])


def test_planner_searches_cp_for_long_sequences_only():
    from threefold.planner.cluster import load_cluster
    from threefold.planner.gpt_cost import gpt_model_cost
    from threefold.planner.search import best_plan, legal_configs
    cluster = load_cluster("a100-80gb")
    long = gpt_model_cost(32, 4096, 32, 51200, 131072)
    best = best_plan(long, 8, 64, cluster)
    assert best.config.plan.cp > 1 and best.fits, best.config.plan
    without = [c for c in legal_configs(long, 8, 64, cluster) if c.plan.cp == 1]
    assert without   # cp=1 plans were candidates: cp won on memory/time, not by being the only option
    short = gpt_model_cost(32, 4096, 32, 51200, 2048)
    assert all(c.plan.cp == 1 for c in legal_configs(short, 8, 64, cluster))


def test_attention_dropout_is_refused_in_one_line():
    from examples.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1))
    idx = torch.randint(0, 32, (2, 17))
    w = {"model": model, "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}
    with pytest.raises(threefold.PlanError, match="attention dropout p=0.1 at h.0.attn.attn_dropout"):
        compile_workload(w, "cp=2")


def test_a_model_without_a_sequence_is_refused_naming_the_dim_cp_cut():
    """Rows of 16 features (no sequence): cp cuts the only other dim, the features, and the trace
    of that share fails in a matmul. Before: "cannot trace" with torch.export's error, as if the
    model did not trace at all."""
    import torch
    import threefold
    from threefold.compiler.api import compile_workload
    torch.manual_seed(0)
    w = {"model": torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
         "inputs": (torch.randn(8, 16),), "target": torch.randn(8, 4), "loss_fn": torch.nn.functional.mse_loss}
    with pytest.raises(threefold.PlanError, match=r"cp=2 cuts input 0 \(8, 16\) along dim 1 \(16 -> 8 positions per "
                                                  r"rank\).*though it traces whole: dim 1 is not a sequence") as err:
        compile_workload(w, "cp=2")
    assert "\n" not in str(err.value)
