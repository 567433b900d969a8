"""Decayed linear attention under cp (plan `cp=N`): MiniMax's lightning attention and RetNet's
retention (tests/zoo/handwritten_lightning.py, HF MiniMax).

Lightning attention over one block (the sequence shorter than the block) reads its decay tables,
buffers, sliced to the traced local length: `D[:, :, :n, :n]` (a grid of positions x positions)
beside the scores Q K^T, `q_decay[:, :n]` beside Q. The grid meets the scores computed whole
(cp_whole.py): it is found by data flow as a table sliced to the sequence (cp_tables.py), reads
this rank's rows and is rebuilt whole (cp_free_whole.py); q_decay reads this rank's rows.
Before: "mul ... mixes sequence positions ... (and it cannot run on the whole sequence:
RuntimeError: Attempting to broadcast a dimension of length 4 ...)"."""
import pytest

from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_jobs import zoo_batch2

ONE_BLOCK = ["hw_lightning", "hw_retention"]


def test_a_decay_grid_sliced_to_the_sequence_is_rebuilt_whole():
    """The grid's slices become index_selects of positions, rebuilt whole beside the whole scores;
    q_decay[:, :n] reads this rank's rows (no table row guessed, no refusal)."""
    from threefold.codegen.artifact import build_sources
    prog = compile_workload(zoo_batch2("hw_lightning"), "cp=2")
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    assert "arange.default(8, " in code and "p_blocks_0_attn_diag_decay, 2, blocks0_attn_arange)" in code, code
    assert "p_blocks_0_attn_q_decay, 1, blocks0_attn_positions)" in code, code
    falls = [n for n in prog.notes if n.startswith("cp fallback:")]
    assert falls and all("matmul" in n for n in falls), falls


def test_a_table_read_from_its_end_reads_this_ranks_rows():
    """`t[-n:]` of a table of L rows: one process reads its last s rows, so rank r reads rows
    L - s + its positions (lightning attention's key decay over one block)."""
    import torch
    from types import SimpleNamespace
    import torch.fx as fx
    from threefold.passes.cp_tables import position_slices
    g = fx.Graph()
    t = g.placeholder("t")
    t.meta.update(val=torch.zeros(4, 16, 1), tf={"kind": "buffer"})
    cut = g.call_function(torch.ops.aten.slice.Tensor, (t, 1, -4, 9223372036854775807))
    cut.meta["val"] = torch.zeros(4, 4, 1)
    stage = SimpleNamespace(seq_len=4, seq_tail=0, plan=SimpleNamespace(cp=2))
    assert position_slices(cut, stage) == [(cut, 1, 16 - 8)]
    short = g.call_function(torch.ops.aten.slice.Tensor, (t, 1, -4, 9223372036854775807))
    short.meta["val"] = torch.zeros(4, 4, 1)
    stage4 = SimpleNamespace(seq_len=4, seq_tail=0, plan=SimpleNamespace(cp=8))   # 32 positions: not a table of them
    assert position_slices(short, stage4) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_decayed_linear_attention_matches_one_process(cp):
    """Losses and every gradient over 3 SGD steps, fp32, against one process."""
    from tests.cp_factory_models import assert_zoo_archs_match, zoo_grads_parity
    assert_zoo_archs_match(launch(zoo_grads_parity, cp, ONE_BLOCK, f"cp={cp}", 3, timeout=550), ONE_BLOCK)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_hf_minimax_matches_one_process_under_cp(cp):
    """HF MiniMax (lightning attention on layer 1, softmax attention and MoE) from a tiny config."""
    from tests.cp_factory_models import grad_diff, reference, zoo_grads_parity
    from tests.parity import max_rel_diff
    got = launch(zoo_grads_parity, cp, ["minimax"], f"cp={cp}", 3, timeout=550)
    ref_losses, ref_grads = reference(zoo_batch2("minimax"))
    for rank in got:
        losses, grads = rank["minimax"]
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)


# -- several blocks per rank: the loop over blocks hands its state rank to rank ----------------

def test_a_loop_over_blocks_hands_its_state_rank_to_rank():
    """Blocks of 2 positions, 8 tokens, cp=2: each rank's trace loops over its 2 local blocks
    (slices x[:, :, 0:2], x[:, :, 2:4] of the split sequence, K^T V carried); the slices are the
    loop's steps (passes/cp_recurrence.py), the state handed on, nothing gathered. Before: "slice
    ... slices along the sequence ... (its bound 2 may be a length: cp cannot tell)"."""
    from threefold.codegen.artifact import build_sources
    prog = compile_workload(zoo_batch2("hw_lightning_blocks"), "cp=2,strict=true")
    code = build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
    for op in ("recur_start(", "recur_mid(", "recur_end("):
        assert code.count(f"cp_recur.{op}") == 2, (op, code)   # one per decoder layer
    assert "cp_gather" not in code


def test_a_block_as_long_as_a_ranks_share_is_named_in_one_line():
    """cp=4 on 8 tokens: a rank holds 2 positions, one block of 2 spans both of its halves, and
    the trace at the local length is one block where one process runs four: refused, naming it."""
    import threefold
    with pytest.raises(threefold.PlanError, match=r"the model sizes it from the length it runs on .* at least 8 "
                       r"such blocks") as err:
        compile_workload(zoo_batch2("hw_lightning_blocks"), "cp=4")
    assert "\n" not in str(err.value)


def test_a_block_bound_equal_to_the_share_is_not_read_as_the_sequence():
    """Tables of 16 rows sliced to a block of 4 on 8 tokens at cp=2: the bound 4 equals s/cp, but
    the model traced at the whole length slices the same 4 rows (two blocks): a constant, not
    the length. Before: read as rows of this rank's positions (one block over the whole
    sequence where one process runs two: right only because lightning's blocks are an exact
    rewrite); now refused in one line."""
    import threefold
    from tests.cp_lightning_models import LongTables
    from tests.zoo.handwritten_attention import decoder_with
    with pytest.raises(threefold.PlanError, match=r"the model sizes it from the length it runs on") as err:
        compile_workload(decoder_with(LongTables)(), "cp=2")
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp, seq", [(2, 8), (2, 32), (4, 16)])
def test_a_loop_over_blocks_matches_one_process(cp, seq):
    """Losses and every gradient over 3 SGD steps, fp32, against one process (2 to 8 blocks of 2
    positions per rank)."""
    from tests.cp_factory_models import grad_diff, reference, zoo_grads_parity
    from tests.parity import max_rel_diff
    got = launch(zoo_grads_parity, cp, ["hw_lightning_blocks"], f"cp={cp}", 3, seq, timeout=550)
    ref_losses, ref_grads = reference(zoo_batch2("hw_lightning_blocks", seq))
    for rank in got:
        losses, grads = rank["hw_lightning_blocks"]
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp, seq", [(2, 16), (4, 32)])
def test_hf_minimax_over_blocks_matches_one_process_under_cp(cp, seq):
    """HF MiniMax with block_size=4: 2 blocks per rank, the state handed rank to rank."""
    from tests.cp_factory_models import grad_diff, reference
    from tests.cp_lightning_models import hf_minimax_blocks, minimax_blocks_parity
    from tests.parity import max_rel_diff
    got = launch(minimax_blocks_parity, cp, f"cp={cp}", seq, 3, timeout=550)
    ref_losses, ref_grads = reference(hf_minimax_blocks(seq))
    for rank in got:
        losses, grads = rank
        assert max_rel_diff(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert grad_diff(grads, ref_grads) < 1e-5, grad_diff(grads, ref_grads)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_decay_tables_compose_with_tp():
    """cp=2,tp=2: tp scatters the decay tables by heads, cp reads them at its positions and
    rebuilds the grid whole (a tp op on a whole value keeps its grown dims). Losses over 3 SGD
    steps against one process (each rank holds only its shards, so the losses carry the check of
    every update)."""
    from tests.cp_factory_models import reference, zoo_grads_parity
    from tests.parity import max_rel_diff
    archs = ["hw_lightning", "minimax"]
    got = launch(zoo_grads_parity, 4, archs, "cp=2,tp=2", 3, timeout=550)
    for arch in archs:
        ref_losses, _ = reference(zoo_batch2(arch))
        for rank in got:
            assert max_rel_diff(rank[arch][0], ref_losses) < 1e-5, (arch, rank[arch][0], ref_losses)
