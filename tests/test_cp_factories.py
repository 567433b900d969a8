"""Values made in forward from the traced length along the sequence under cp (passes/cp_factories.py):
a ones mask made when none is given (OPT's positions by cumsum, DeBERTa's embedding mask), a
count made by `full` and summed over time. Each was refused ("varies per position"); now the
factory is the whole-length one cut to this rank's blocks, a scan over it takes the exact
all-gather fallback, and cp=2 equals one process (losses and gradients, fp32, 3 SGD steps)."""
import pytest
import torch

from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_jobs import input_seq_dims
from tests.cp_factory_models import MODES, factory_parity, factory_workload, grad_diff, reference, zoo_grads_parity
from tests.parity import max_rel_diff


@pytest.mark.parametrize("mode,scans", [("cumsum", 1), ("scale", 0), ("running", 2)])
def test_factory_along_the_sequence_is_split_and_its_scans_carried(mode, scans):
    from threefold.codegen.artifact import build_sources
    prog = compile_workload(factory_workload(mode), "cp=2")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes
    assert build_sources(prog)["chunk00.py"].split("def model_outputs")[0].count("cp_scan.scan_seq(") == scans


def test_alibi_table_sliced_to_its_last_keys_runs_in_the_ring():
    """MPT's ALiBi: a [heads, 1, L] table sliced to its last t keys. At the whole length the
    slice is the last s rows (was evaluated at t rows: "(2, 1, 8), not over the sequence"),
    and its bias shifts with the length by a number per query the softmax ignores."""
    from threefold.codegen.artifact import build_sources
    code = build_sources(compile_workload(factory_workload("alibi_tail"), "cp=2"))["chunk00.py"]
    assert "rel=(None, 0, [0.5, 0.25]" in code


def test_sequence_dim_is_the_one_candidate_cp_compiles():
    """Input [2, 16, 16]: both dims could be the sequence by their sizes (was "cannot tell the
    sequence dim ... candidates [1, 2]"); the linear layer reads dim 2 whole, so only dim 1
    compiles, and the note says why."""
    prog = compile_workload(factory_workload("seq_probe"), "cp=2")
    note = [n for n in prog.notes if "sequence is dim" in n]
    assert len(note) == 1 and note[0].startswith("cp: input 0's sequence is dim 1,") and "dim 2: " in note[0], note
    assert input_seq_dims(prog)[0] == 1


def test_sequence_dim_still_asked_where_each_candidate_compiles():
    """Nothing in the graph tells the dims apart (an elementwise model): the one-line question stays."""
    import torch
    import threefold

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * self.w
    x = torch.randn(2, 8, 8)
    w = {"model": Scale(), "inputs": (x,), "target": torch.zeros(2, 8, 8), "loss_fn": torch.nn.functional.mse_loss}
    with pytest.raises(threefold.PlanError, match="cannot tell the sequence dim of input 0"):
        compile_workload(w, "cp=2")


def test_grids_of_positions_are_computed_whole_on_every_rank():
    """Relative positions i - j and a mask paired with itself, read by scores the ring does not
    take (was "pairs query positions with key positions"): computed whole, and the
    probabilities times the gathered values cut back to this rank's blocks. The grids made of
    positions and ones alone (no input) are computed whole on every rank with nothing gathered
    (passes/cp_free_whole.py); the scores that meet them are gathered."""
    prog = compile_workload(factory_workload("relpos"), "cp=2")
    falls = " ".join(n for n in prog.notes if n.startswith("cp fallback:"))
    for op in ("matmul (", "gather ("):
        assert f"cp fallback: {op}" in falls, (op, falls)
    for op in ("sub (", "mul ("):
        assert f"cp fallback: {op}" not in falls, (op, falls)


def test_mask_broadcast_over_keys_beside_a_position_bias_runs_in_the_ring():
    """T5's all-visible mask [b, 1, q, k], expanded over its keys, added with a relative-position
    bias (was "cannot run on the gathered sequence"): the bias is computed per ring step
    (passes/cp_attention_bias.py), the mask is the ring's own, and nothing is gathered."""
    from threefold.codegen.artifact import build_sources
    prog = compile_workload(factory_workload("t5bias"), "cp=2")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")]
    assert "pbias=" in build_sources(prog)["chunk00.py"]


class _GridOverNumber(torch.nn.Module):
    """Relative positions i - j (a grid computed whole under cp) divided by the length t (a
    length: 8 at cp=2 of 16, 16 whole) or by the constant 8 (equal to s/cp by coincidence)."""

    def __init__(self, by_length: bool):
        super().__init__()
        self.by_length = by_length
        self.emb, self.head = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)

    def forward(self, idx):
        t = idx.shape[1]
        x, i = self.emb(idx), torch.arange(t)
        rel = (i[:, None] - i[None, :]).float() / (t if self.by_length else 8)
        return self.head(x + rel @ x)


def test_whole_grid_beside_a_number_equal_to_the_local_length_is_refused_unless_a_constant():
    """A number equal to s/cp beside a grid computed whole: the model traced at the whole length
    tells a length (refused in one line) from a constant (DeBERTa's bucket middle at 8 tokens,
    which was refused as well; tests/test_cp_whole_constants.py)."""
    import threefold
    w = factory_workload("relpos")
    w["model"] = _GridOverNumber(by_length=True)
    with pytest.raises(threefold.PlanError, match="names the number 8, the local length") as err:
        compile_workload(w, "cp=2")
    assert "\n" not in str(err.value)
    w["model"] = _GridOverNumber(by_length=False)
    prog = compile_workload(w, "cp=2")
    assert any(n.startswith("cp fallback: matmul") for n in prog.notes)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_factories_at_cp2_match_one_process_losses_and_grads():
    got = launch(factory_parity, 2, MODES, "cp=2", 3, timeout=550)
    for i, mode in enumerate(MODES):
        ref_losses, ref_grads = reference(factory_workload(mode))
        for rank in got:
            losses, grads = rank[i]
            assert max_rel_diff(losses, ref_losses) < 1e-5, (mode, losses, ref_losses)
            assert grad_diff(grads, ref_grads) < 1e-4, (mode, grad_diff(grads, ref_grads))


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_opt_mpt_t5_deberta_at_cp2_match_one_process_losses_and_grads():
    """HF OPT numbers its learned positions by a cumsum over a ones mask made in forward; MPT
    slices its ALiBi table to the last keys; T5's bucketed relative-position bias and
    DeBERTa-v2's disentangled attention is computed
    whole (at seq 24: at 8 and 16 its bucket sizes equal s/cp, refused as a coincidence)."""
    from tests.cp_jobs import zoo_batch2
    archs = ["opt", "mpt", "t5"]
    got = launch(zoo_grads_parity, 2, archs, "cp=2", 3, timeout=850)
    got24 = launch(zoo_grads_parity, 2, ["deberta_v2"], "cp=2", 3, 24, timeout=850)
    for g, r in zip(got, got24):
        g.update(r)
    for arch in archs + ["deberta_v2"]:
        ref_losses, ref_grads = reference(zoo_batch2(arch, 24 if arch == "deberta_v2" else None))
        for rank in got:
            losses, grads = rank[arch]
            assert max_rel_diff(losses, ref_losses) < 1e-5, (arch, losses, ref_losses)
            assert grad_diff(grads, ref_grads) < 1e-4, (arch, grad_diff(grads, ref_grads))


def test_a_reshape_of_a_whole_value_is_carried_to_the_whole_length():
    """reshape names its size `shape` (view and expand: `size`): carrying it to the whole
    sequence crashed the cp pass (Doge's mask under a held-out survey)."""
    import torch
    import torch.fx as fx
    from threefold.passes.cp_whole import regrow, remember
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 16)            # made whole (s = 16), traced at s/cp = 8
    remember(x, torch.empty(4, 8))
    for op in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
        r = g.call_function(op, (x, [32]))
        r.meta["val"] = torch.empty(32)
        regrow(r, 8, "why")
        assert r.args[1] == [64]


def test_a_factory_whose_batch_equals_the_local_length_is_read_from_the_retrace():
    """OPT at the zoo's own batch, 4 rows of 8 tokens: its ones(b, T) mask is (4, 4) at cp=2,
    both dims the local length; the model traced at 8 tokens says dim 1 is the sequence (was
    refused as a value that varies per position)."""
    from tests.zoo import ZOO
    from threefold.codegen.artifact import build_sources
    prog = compile_workload(ZOO["opt"](), "cp=2")
    assert "cp_scan.scan_seq(" in build_sources(prog)["chunk00.py"].split("def model_outputs")[0]
