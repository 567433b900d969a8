"""Context parallelism's sequence rules (passes/cp_rules/) over the op registry
(threefold/ops/families.py): arguments read by name from the op's schema, every op tp knows
has a cp decision, ops that run along the sequence (topk, sort, scans) take the all-gather
fallback and equal one process at cp=2."""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.ops.families import args_of, family
from threefold.passes.cp_rules import GATHERABLE, decision_for
from threefold.runtime.launch import launch
from tests.cp_jobs import mixing_parity, position_parity
from tests.cp_mask_models import mixing_workload, position_workload
from tests.parity import max_rel_diff, sgd_losses

_GENERIC = "has no context-parallel rule"


def _fallbacks(prog) -> list:
    return [n for n in prog.notes if n.startswith("cp fallback:")]


def test_args_are_read_by_schema_name():
    g = fx.Graph()
    x = g.placeholder("x")
    top = g.call_function(torch.ops.aten.topk.default, (x, 2), {"dim": 1})
    norm = g.call_function(torch.ops.aten.norm.ScalarOpt_dim, (x, 2.0, [-1]))
    srt = g.call_function(torch.ops.aten.sort.stable, (x,), {"stable": True, "dim": 0})
    assert args_of(top) == {"self": x, "k": 2, "dim": 1, "largest": True, "sorted": True}
    assert args_of(norm)["p"] == 2.0 and args_of(norm)["dim"] == [-1] and args_of(norm)["keepdim"] is False
    assert args_of(srt)["dim"] == 0 and args_of(srt)["descending"] is False


def test_topk_over_the_sequence_is_gathered_not_run_on_local_positions():
    """k-max pooling, topk(x, 2, dim=1) over time: once read as dim=k=2 (position-wise,
    silently wrong); now the sequence is gathered around it."""
    prog = compile_workload(mixing_workload("kmax"), "cp=2")
    notes = _fallbacks(prog)
    assert len(notes) == 1 and notes[0].startswith("cp fallback: topk ("), notes
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert code.count("cp_gather.gather_seq(") == 1 and code.count("cp_gather.shard_seq(") == 0


def test_router_topk_over_experts_stays_position_wise():
    """topk(k=2, dim=-1) over [tokens, experts]: once read as dim=k=2 -> 0, the tokens dim,
    and refused as running along the sequence."""
    prog = compile_workload(mixing_workload("router"), "cp=2")
    assert _fallbacks(prog) == []


@pytest.mark.parametrize("mode,op,cut", [("sort", "sort", True), ("cummax", "cummax", True)])
def test_sorts_and_scans_over_the_sequence_take_the_fallback(mode, op, cut):
    prog = compile_workload(mixing_workload(mode), "cp=2")
    notes = _fallbacks(prog)
    assert len(notes) == 1 and notes[0].startswith(f"cp fallback: {op} ("), notes
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    # sort has two outputs: values and indices both run along the sequence, each cut back
    assert code.count("cp_gather.shard_seq(") == (2 if mode == "sort" else 1)


def test_sdpa_enable_gqa_runs_in_the_ring():
    prog = compile_workload(mixing_workload("gqa"), "cp=2")
    assert any("1 attention op(s) run as ring attention" in n for n in prog.notes), prog.notes
    assert "repeat_interleave" in build_sources(prog)["chunk00.py"]


def test_every_op_with_a_tp_rule_has_a_cp_decision():
    """A rule, or a refusal that says why (not the generic 'no rule'): a family cannot be
    forgotten by cp again."""
    from threefold.passes.tp_rules import RULES
    missing = {n: d for n in RULES for d in [decision_for(n)] if isinstance(d, str) and d.startswith(_GENERIC)}
    assert not missing, missing
    reasoned = {n: d for n in RULES for d in [decision_for(n)] if isinstance(d, str)}
    assert set(reasoned) <= {"call_loss", "scaled_dot_product_attention"}, reasoned


def test_ops_that_run_along_one_dim_may_fall_back():
    for name in ("topk", "sort", "argsort", "cumsum", "cumprod", "logcumsumexp", "softmax", "sum",
                 "linalg_vector_norm", "einsum"):
        assert family(name) in GATHERABLE, name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sequence_ops_cp2_match_one_process():
    modes = ["kmax", "sort", "cumprod", "router", "gqa", "route"]
    got = launch(mixing_parity, 2, modes, "cp=2", 3, timeout=550)
    for i, mode in enumerate(modes):
        ref = sgd_losses(mixing_workload(mode), 3)
        for rank in got:
            assert max_rel_diff(rank[i], ref) < 1e-5, (mode, rank[i], ref)


def test_full_length_table_that_cannot_be_read_locally_is_one_line():
    """A parameter of the whole length used whole where cp cannot read it at this rank's
    positions (it is contracted with the sequence, not added): a PlanError naming it and the fix."""
    import threefold

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mix = torch.nn.Embedding(32, 8), torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, idx):
            return torch.einsum("ts,bsc->btc", self.mix, self.emb(idx)) @ self.emb.weight.T

    idx = torch.randint(0, 32, (2, 17))
    w = {"model": Mixer(), "inputs": (idx[:, :-1],), "target": idx[:, 1:],
         "loss_fn": lambda y, t: torch.nn.functional.cross_entropy(y.reshape(-1, 32), t.reshape(-1))}
    with pytest.raises(threefold.PlanError, match="parameter `mix`.*slice it to the input's length"):
        compile_workload(w, "cp=2")


@pytest.mark.parametrize("arch", ["deepseek_v3", "bert_mlm", "qwen3_moe"])
def test_zoo_models_once_refused_compile_position_wise(arch):
    """new_empty filled by slices (DeepSeek's key), a buffer gathered at position ids (BERT's
    token types), a routing sort (Qwen3-MoE): no fallback, no refusal (parity: -m zoo)."""
    from tests.cp_jobs import zoo_batch2
    prog = compile_workload(zoo_batch2(arch), "cp=2")
    assert _fallbacks(prog) == []


def test_routing_sort_keeps_each_ranks_rows():
    """A MoE's argsort of token-expert rows by expert over the merged [b*t*k] dim: once refused
    (it cannot be gathered); each rank now routes its own rows and puts them back (no fallback)."""
    prog = compile_workload(mixing_workload("route"), "cp=2")
    assert _fallbacks(prog) == []
    code = build_sources(prog)["chunk00.py"]
    assert "gather_seq" not in code and "zoo_moe.gmm" in code


def test_sorted_rows_read_as_positions_are_refused_not_trained_wrong():
    """The same sorted rows added back as if they were this rank's positions: one process
    mixes tokens across the whole sequence there, so cp refuses in one line."""
    import threefold
    with pytest.raises(threefold.PlanError, match="sorted on this rank"):
        compile_workload(mixing_workload("route_leak"), "cp=2")


@pytest.mark.parametrize("mode", ["learned", "ids", "rotary", "whole"])
def test_position_tables_sliced_to_the_sequence_read_this_ranks_rows(mode):
    """t[:T] of a table of parameters/buffers that meets the sequence: once refused ("varies
    per position"); now t.index_select(dim, positions) (found by data flow, not op name).
    whole (`x + self.pos` of the full length): once an export failure (a broadcast error)."""
    prog = compile_workload(position_workload(mode), "cp=2")
    tables = 2 if mode == "rotary" else 1
    assert any(f"{tables} position table(s) sliced to the sequence" in n for n in prog.notes), prog.notes
    assert _fallbacks(prog) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_position_tables_cp2_match_one_process():
    modes = ["learned", "ids", "rotary", "whole"]
    got = launch(position_parity, 2, modes, "cp=2", 3, timeout=550)
    for i, mode in enumerate(modes):
        ref = sgd_losses(position_workload(mode), 3)
        for rank in got:
            assert max_rel_diff(rank[i], ref) < 1e-5, (mode, rank[i], ref)


def test_ops_command_lists_every_op_per_axis(capsys):
    import json
    from threefold.cli.main import main
    assert main(["ops", "--json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["topk"]["family"] == "sort" and "all-gather fallback" in rows["topk"]["cp"]
    assert rows["matmul"]["tp"].startswith("rule") and rows["matmul"]["cp"].startswith("rule")
    assert rows["call_loss"]["cp"].startswith("refused: ") and all(r["tp"] and r["cp"] for r in rows.values())
    assert main(["ops", "--axis", "cp"]) == 0 and "tp" not in capsys.readouterr().out.splitlines()[0]


def test_attention_the_ring_does_not_take_runs_on_the_gathered_sequence(monkeypatch):
    """(bench/cp_fallback_cost.py measures this path against the ring: same losses.)"""
    from threefold.passes import cp_attention
    monkeypatch.setattr(cp_attention, "_sdpa", lambda node: None)
    prog = compile_workload(position_workload("rotary"), "cp=2")
    notes = _fallbacks(prog)
    assert len(notes) == 3 and all(n.startswith("cp fallback: scaled_dot_product_attention (") for n in notes)
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert code.count("cp_gather.gather_seq(") == 3 and code.count("cp_gather.shard_seq(") == 1


def test_sizes_equal_to_the_local_length_are_read_from_a_trace_at_the_whole_length():
    """Mistral with sliding_window=4 at 8 tokens and 4 rows, cp=2: the window, the batch and
    HF's arange(batch) all equal the local length 4. Read by replacing every 4 with 8, the
    window became 8 (trained 1e-2 off one process, silently), and arange(batch) an expand
    error; refused since. The mask is now read from the model traced at 8 positions."""
    from tests.zoo import ZOO
    code = build_sources(compile_workload(ZOO["mistral"](), "cp=2"))["chunk00.py"]
    assert "rel=(-3, 0, [0.0], [0.0], ())" in code    # visible for -3 <= j - i <= 0: a window of 4


def test_a_seq_first_model_is_split_along_its_sequence_without_batch_dims():
    """nn.TransformerEncoder with batch_first=False takes [S=8, B=4]: with dp*m = 1 no batch
    dim was looked for, dim 0 was taken for the batch and cp asked for batch_dims=1. The rows
    are found by data flow as for a dp split (tests/zoo matrix: cp=2 matches one process)."""
    from tests.zoo import ZOO
    prog = compile_workload(ZOO["nn_encoder_seq_first"](), "cp=2")
    from tests.cp_jobs import input_seq_dims
    assert input_seq_dims(prog) == [0, 0]


def test_rows_tiled_per_expert_keep_their_positions():
    """Llama 4's MoE repeats the [b*s] token rows once per expert (`x.repeat(E, 1)`): one more
    outer digit on a dim that already merges the sequence, refused before as a repeat "along
    the sequence" (a held-out survey; the zoo matrix runs its cp=2 parity); a repeat of an
    unmerged sequence stays refused."""
    from tests.zoo import ZOO
    prog = compile_workload(ZOO["llama4_text"](), "cp=2")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")]

    class Tiled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)

        def forward(self, idx):
            return self.head(self.emb(idx).repeat(1, 2, 1))[:, :idx.shape[1]]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (2, 9), generator=g)
    w = {"model": Tiled(), "inputs": (idx[:, :-1],), "target": idx[:, 1:],
         "loss_fn": lambda y, t: F.cross_entropy(y.reshape(-1, 32), t.reshape(-1))}
    import threefold
    with pytest.raises(threefold.PlanError, match="repeats along the sequence"):
        compile_workload(w, "cp=2")


class _FeatureOps(torch.nn.Module):
    """Per-position ops on the feature dim (issue 40): a vector norm over the last dim,
    tensor_split / split of features, repeat and repeat_interleave of heads, outer of a
    position vector, einsum projections."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.w = torch.nn.Parameter(torch.randn(2, 8, 8) * 0.1)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        a, c = x.tensor_split(2, dim=-1)
        d, e = x.split(8, dim=-1)
        heads = torch.einsum("btc,hcd->bhtd", a, self.w)                     # [b, 2, t, 8]
        heads = heads.repeat(1, 2, 1, 1) + heads.repeat_interleave(2, dim=1)  # GQA-style head repeats
        ang = torch.outer(torch.arange(t).float(), torch.ones(8))             # [t, 8] per position
        y = heads.mean(dim=1) * torch.cos(ang) + c + d * e
        return self.head(torch.cat([y, y], dim=-1))


def test_per_position_feature_ops_stay_position_wise():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (2, 17), generator=g)
    w = {"model": _FeatureOps(), "inputs": (idx[:, :-1],), "target": idx[:, 1:],
         "loss_fn": lambda y, t: torch.nn.functional.cross_entropy(y.reshape(-1, y.size(-1)), t.reshape(-1))}
    prog = compile_workload(w, "cp=2")
    assert _fallbacks(prog) == [] and any("1 sequence arange(s) give global positions" in n for n in prog.notes)
