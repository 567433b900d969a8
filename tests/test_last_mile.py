"""Issue 21 items 3-6: models a new user brings (HF caches, untraceable losses, uneven
shards, projections reached through repeat / copy_ / complex views / gather).

Compile-level checks run in the default suite; parity cells (zoo workloads, world size 2,
one launched job) are marked slow."""
import pytest
import torch

from threefold.compiler.api import compile_workload
from threefold.errors import PlanError
from tests.zoo import ZOO
from tests.zoo.ctc import ctc_loss


def test_hf_cache_compiles_under_tp_and_its_empty_start_is_gone():
    # use_cache=True: each layer's cache starts as torch.tensor([]) and is cat with the new
    # keys; the tensor-parallel rules used to see a cat of a 1-D value with a 4-D one.
    fused = compile_workload(ZOO["llama_cache"](), "tp=2")
    for _, gm in fused.graph_modules():
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten.cat.default:
                assert all(a.meta["val"].dim() > 1 for a in n.args[0]), n.format_node()


def test_untraceable_loss_runs_eagerly_and_combines_as_a_row_mean():
    prog = compile_workload(ZOO["conv_ctc"](), "pp=2,m=2")
    assert any("runs eagerly" in n and "_ctc_loss" in n for n in prog.notes), prog.notes
    # CTC's reduction="mean" is a mean over rows (each divided by its label length):
    # numerator = loss * rows of the microbatch, denominator = rows, summed over microbatches
    assert prog.loss_form["reduction"] == "mean", prog.loss_form
    assert prog.loss_form["denominator"] == {"kind": "const", "value": 2}, prog.loss_form


def squared_ctc(logits, labels):
    return ctc_loss(logits, labels) ** 2


def test_eager_loss_that_is_neither_row_mean_nor_sum_is_refused_only_when_split():
    w = ZOO["conv_ctc"]()
    w["loss_fn"] = squared_ctc
    with pytest.raises(PlanError, match="squared_ctc is neither the mean nor the sum"):
        compile_workload(w, "pp=2,m=2")
    compile_workload(w, "pp=2")      # one microbatch: nothing to combine


# (arch, plan) cells of one world-size-2 job; every one must match one process.
PARITY = [("llama_cache", "tp=2"), ("llama_cache", "pp=2,m=2"),
          ("conv_ctc", "tp=2"), ("conv_ctc", "pp=2,m=2"), ("wav2vec2_ctc", "tp=2"),
          ("llama", "pp=2,m=2,loss=eager"),
          ("vit17", "tp=2,sp=true"), ("gpt_seq7", "tp=2,sp=true"),
          ("meta_llama", "tp=2"), ("deberta_v2", "tp=2"), ("rwkv", "tp=2"), ("rwkv", "pp=2,m=2"),
          ("hw_three_heads", "tp=2"), ("hw_odd_ffn", "tp=2")]
# per-rank parameters at tp=2 over tp=1 (1 - share/2) must be at most this (issue: 0.55;
# RWKV's feed-forward receptance stays whole, listed by inspect: its product with the
# row-parallel value output reaches the next LayerNorm)
MAX_PER_RANK = {"meta_llama": 0.55, "deberta_v2": 0.55, "rwkv": 0.56,
                "hw_three_heads": 0.52, "hw_odd_ffn": 0.52}   # padded, not kept whole

_cells: dict = {}


def _parity_cells() -> dict:
    if not _cells:
        from tests.zoo.matrix import run_matrix
        archs = sorted({a for a, _ in PARITY})
        plans = sorted({p for _, p in PARITY})
        _cells.update(run_matrix(archs, plans, log=lambda s: None, only=set(PARITY))["cells"])
    return _cells


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch,plan", PARITY)
def test_last_mile_cells_match_single_process(arch, plan):
    verdict = _parity_cells()[(arch, plan)]
    assert verdict["verdict"] == "pass", (arch, plan, verdict)
    if arch in MAX_PER_RANK and plan == "tp=2":
        assert 1 - verdict["share"] / 2 <= MAX_PER_RANK[arch], (arch, verdict["share"])


class _RescaledInForward(torch.nn.Module):
    """Writes its own weight in place under no_grad in forward, by a factor that is 1 in
    training (as HF RWKV's layer rescaling does), then uses it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(1)
        return self.lin(x)


def test_weight_written_in_place_under_no_grad_keeps_its_gradient():
    # eager: the parameter stays the same tensor, gradients included; the trace used to read
    # a detached alias of it afterwards (no gradient), and under pp an in-place op on a leaf
    from threefold.compiler.trace import trace
    x = torch.randn(4, 8)
    prog = trace(_RescaledInForward(), (x,), torch.randn(4, 8), torch.nn.functional.mse_loss)
    ops = [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mul_.Tensor not in ops and torch.ops.aten.detach.default not in ops, ops
    linear = next(n for n in prog.gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert linear.args[1].op == "placeholder", linear.format_node()


def test_buffer_written_under_no_grad_carries_no_graph_into_the_next_step():
    # `running.mul_(0.9).add_(0.1 * h.mean())` under no_grad: the buffer keeps its identity
    # after tracing, but the write must not record a graph (it used to: step 2 then ran
    # backward through step 1's freed graph, and gradients flowed into h through the buffer)
    import tempfile
    import threefold
    from tests.parity import sgd_losses
    torch.manual_seed(1234)
    w = ZOO["hw_running_buffer"]()
    with tempfile.TemporaryDirectory() as workdir:
        pm = threefold.parallelize(w["model"], "tp=1", w["inputs"], w["loss_fn"], target=w["target"],
                                   workdir=workdir)
        opt = pm.optimizer(torch.optim.SGD, lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(pm.step(*w["inputs"], target=w["target"]))
            opt.step()
    ref = sgd_losses(ZOO["hw_running_buffer"](), 3)
    assert losses == pytest.approx(ref, rel=1e-6, abs=0), (losses, ref)


def test_heads_and_features_tp_does_not_divide_are_padded_and_inspect_shows_it():
    # 3 heads at tp=2: cut as 4 (a zero head on rank 1), whole heads per rank; the output
    # projection gets zero input columns. A 37-wide MLP: 38 features, one zero.
    from threefold.cli.inspect_params import parameter_rows
    prog = compile_workload(ZOO["hw_three_heads"](), "tp=2")
    q = prog.shard_fns["blocks.0.attn.q.weight"]
    assert (q.dim, q.padded) == (0, 32), q
    full = prog.state["blocks.0.attn.q.weight"]
    assert torch.equal(q(full, 0), full[:16]) and torch.equal(q(full, 1)[:8], full[16:])
    assert not q(full, 1)[8:].any()
    o = prog.shard_fns["blocks.0.attn.o.weight"]
    assert (o.dim, o.padded) == (1, 32), o
    assert any("3 heads padded to 4 for tp=2" in n for n in prog.notes), prog.notes
    assert not prog.tp_report["replicated_weights"] and not prog.tp_report["fallbacks"], prog.tp_report
    rows = {r["fqn"]: r for r in parameter_rows(prog)}
    assert "padded=32" in rows["blocks.0.attn.o.weight"]["placement"], rows["blocks.0.attn.o.weight"]
    ffn = compile_workload(ZOO["hw_odd_ffn"](), "tp=2")
    assert ffn.shard_fns["blocks.1.mlp.fc.weight"].padded == 38
    assert ffn.shard_fns["blocks.1.mlp.proj.weight"].padded == 38


def test_falcon_fused_multi_query_qkv_shards_its_queries_and_keeps_one_kv_head_whole():
    # query_key_value's output is viewed [.., heads + 2, head_dim] and cut by a slice and two
    # constant indices: one linear per piece of the weight, the queries column-parallel, the
    # single key and value head whole on every rank (blocks marked whole in the ShardSpec)
    from threefold.checkpoint.layout import pieces
    prog = compile_workload(ZOO["falcon"](), "tp=2")
    fqn = "model.transformer.h.0.self_attention.query_key_value.weight"
    spec = prog.shard_fns[fqn]
    assert (spec.blocks, spec.whole) == ((32, 8, 8), (False, True, True)), spec
    full = prog.state[fqn]
    assert torch.equal(spec(full, 1), torch.cat([full[16:32], full[32:]]))
    assert [p.length for p in pieces(spec, full.shape, 1)[1]] == [16, 8, 8]
    assert [p.length for p in pieces(spec, full.shape, 1, owned=True)[1]] == [16]   # counted once
    rep = prog.tp_report
    assert not rep["replicated_weights"] and not rep["fallbacks"], rep
    assert 1 - rep["sharded_share"] / 2 <= 0.55, rep["sharded_share"]   # was 0.607 per rank


def test_padded_vocabulary_still_reaches_the_vocab_parallel_cross_entropy():
    # a padded vocabulary's logits are also "local x tp > traced size": the cross-entropy
    # handles that padding itself and must not be refused as a padded-heads consumer
    from tests.parity import load_workload
    prog = compile_workload(load_workload("gpt", n_layer=1, n_embd=16, n_head=2, vocab_size=97, seq=8, batch=4),
                            "tp=2")
    assert prog.tp_report["replicated_weights"] == {} and prog.tp_report["fallbacks"] == [], prog.tp_report
