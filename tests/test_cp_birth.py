"""cp (plan `cp=N`) on models whose sequence is born inside forward (compiler/seq_birth.py):
ViTs take pixels [B, 3, H, W]; cp starts where the patch tokens are made (after the patch
conv's flatten, or the CLS token's cat), the ops before it run whole on every cp rank. Before:
"no dim of input 0 is the sequence ...; cp splits a sequence the inputs carry: use cp=1", and a
square image whose width 2*cp divides was cut along its width, 2.7e-3 off in the loss."""
from __future__ import annotations

import pytest

import threefold
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_birth_jobs import compare, vit_parity, vit_reference, vit_workload


def _code(prog) -> str:
    from threefold.codegen.artifact import build_sources
    return build_sources(prog)["chunk00.py"]


@pytest.mark.parametrize("arch,born", [("vit16_mean", "flatten"), ("hf_vit16", "cat")])
def test_cp_starts_where_the_sequence_is_born_and_says_so(arch, born):
    prog = compile_workload(vit_workload(arch), "cp=2")
    note = next(n for n in prog.notes if "born inside the model" in n)
    assert f"at `{born}`" in note and "16 positions" in note and "conv2d" in note, note
    code = _code(prog)
    assert "cp_cut" not in code and "shard_seq(" in code
    assert "gather_seq(conv2d" not in code   # the image is not gathered: it was never cut
    assert not any(n.startswith("cp fallback:") for n in prog.notes), prog.notes   # mean: partial sums all-reduced
    assert "gather_seq(" not in code


def test_a_cls_read_takes_one_position_from_the_rank_that_holds_it():
    code = _code(compile_workload(vit_workload("vit16_cls"), "cp=2"))
    assert "select_seq(" in code and "gather_seq(" not in code


def test_a_position_table_interpolated_in_forward_is_cut_where_it_meets_the_sequence():
    """Dinov2 interpolates its 10-position table to the 12x20 image's 16 tokens (bicubic, in
    forward) and adds it whole: the cut trace cuts that value too (exact: broadcasting pairs
    the same positions)."""
    prog = compile_workload(vit_workload("hf_dinov2_16"), "cp=2")
    assert any("meet the cut sequence element-wise" in n for n in prog.notes), prog.notes
    assert _code(prog).split("def model_outputs")[0].count("shard_seq(") == 2   # the tokens and the table


def test_a_target_along_the_born_sequence_is_cut_with_it():
    from tests.cp_jobs import input_seq_dims
    prog = compile_workload(vit_workload("per_patch"), "cp=2")
    assert input_seq_dims(prog) == [None, 1], input_seq_dims(prog)   # images whole, target [B, 16] cut


def test_a_born_length_2cp_does_not_divide_is_padded_at_the_cut():
    """17 tokens (CLS + 16 patches) at cp=2: padded to 20 at the cut (passes/cp_padding.py), the
    3 padded keys hidden from every query of the non-causal attention. Before: a PlanError."""
    prog = compile_workload(vit_workload("vit17"), "cp=2")
    assert any("born inside the model at `cat`" in n and "padded by 3 position(s)" in n for n in prog.notes), prog.notes
    code = _code(prog)
    assert code.count("limit=17") == code.count("cp_ops.ring_attention(") > 0   # every ring hides the padding


def test_a_mean_over_the_patch_rows_without_cls_is_partial_sums_without_the_tail():
    """x[:, 1:].mean(1) (Dinov2's and BEiT's classifiers) after a sequence born inside the model:
    a mean over a sequence shortened inside the model, all-reduced partial sums that leave out
    the dropped position (and the padding). Before: refused ("reads a value shortened along the
    sequence")."""
    from threefold.codegen.artifact import build_sources
    for arch, tail in (("patch_mean", 1), ("patch_mean17", 4)):
        code = build_sources(compile_workload(vit_workload(arch), "cp=2"))["chunk00.py"]
        assert "cp_gather.reduce_seq(" in code and f"tail={tail}" in code, (arch, code)


def test_an_artifact_with_the_cut_saves_and_loads(tmp_path):
    from threefold.codegen.artifact import save_artifact
    from threefold.runtime.loader import load_chunk, open_artifact
    w = vit_workload("vit16_mean")
    save_artifact(compile_workload(w, "cp=2"), str(tmp_path / "art"), batch=(*w["inputs"], w["target"]))
    chunk = load_chunk(open_artifact(str(tmp_path / "art")), 0)
    assert "shard_seq" in open(tmp_path / "art" / "chunk00.py").read() and chunk is not None


def _assert_vits_match(archs: list, plan: str, ranks: int) -> None:
    """Each ViT under `plan` on `ranks` ranks: losses and every gradient over 3 SGD steps."""
    got = launch(vit_parity, ranks, archs, plan, 3, timeout=550)
    for arch in archs:
        for loss, grad, _ in compare([rank[arch] for rank in got], vit_reference(arch)):
            assert loss < 1e-5 and grad < 1e-4, (arch, plan, loss, grad)


MATRIX = [("cp=2", 2), ("cp=4", 4), ("dp=2,cp=2", 4)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan,ranks", MATRIX, ids=[p for p, _ in MATRIX])
def test_vits_born_inside_match_one_process(plan, ranks):
    """(a) a hand-written ViT of 16 patch tokens, mean-pooled; (b) HF ViTForImageClassification
    with 15 patches + CLS: losses and every gradient over 3 SGD steps."""
    _assert_vits_match(["vit16_mean", "hf_vit16"], plan, ranks)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan,ranks", [("cp=2", 2), ("cp=4", 4)], ids=["cp=2", "cp=4"])
def test_vits_of_17_tokens_match_one_process(plan, ranks):
    """The zoo's 17-token ViTs (hand-written and HF), born inside the model at a length 2cp does
    not divide: padded at the cut, losses and every gradient over 3 SGD steps."""
    _assert_vits_match(["vit17", "hf_vit17"], plan, ranks)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan,ranks", [("cp=2", 2), ("cp=4", 4)], ids=["cp=2", "cp=4"])
def test_a_mean_over_the_patch_rows_matches_one_process(plan, ranks):
    """x[:, 1:].mean(1) pooled, at 16 tokens and at 17 (padded): losses and every gradient."""
    _assert_vits_match(["patch_mean", "patch_mean17"], plan, ranks)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cls_vit_a_per_patch_target_and_a_first_token_read_match_one_process():
    """(c) CLS + 15 patches, a learned position table of 16 added whole, the CLS row pooled; a
    per-patch target [B, 16], cut to this rank's positions as the born sequence is; an LM that
    reads its first token at every position (x + x[:, 0]; refused before as "selects one position");
    HF DeiT (CLS and distillation rows read) and Dinov2 (its position table interpolated in forward)."""
    archs = ["vit16_cls", "per_patch", "first_token", "hf_deit16", "hf_dinov2_16"]
    got = launch(vit_parity, 2, archs, "cp=2", 3, timeout=550)
    for arch in archs:
        for loss, grad, _ in compare([rank[arch] for rank in got], vit_reference(arch)):
            assert loss < 1e-5 and grad < 1e-4, (arch, loss, grad)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["tp=2,cp=2", "pp=2,cp=2"])
def test_the_born_sequence_composes_with_tp_and_pp(plan):
    """Losses, and the gradients of every parameter a rank holds whole (the prefix's among them
    on the ranks that run it)."""
    got = launch(vit_parity, 4, ["vit16_mean"], plan, 3, timeout=550)
    results = compare([rank["vit16_mean"] for rank in got], vit_reference("vit16_mean"), whole_only=True)
    for loss, grad, names in results:
        assert loss < 1e-5 and grad < 1e-4, (plan, loss, grad)
    assert any("patch.weight" in names for _, _, names in results)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_saved_artifact_with_the_cut_trains_like_one_process(tmp_path):
    """`threefold run` on the saved cp=2 artifact of HF ViT (no model source needed)."""
    import json
    import os
    import subprocess
    import sys
    from threefold.codegen.artifact import save_artifact
    from tests.parity import max_rel_diff
    w = vit_workload("hf_vit16")
    save_artifact(compile_workload(w, "cp=2"), str(tmp_path / "art"), batch=(*w["inputs"], w["target"]))
    root = os.path.dirname(os.path.dirname(threefold.__file__))   # threefold itself, wherever it is imported from
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(tmp_path / "art"), "--json"], cwd=str(tmp_path),
                         env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    ref = vit_reference("hf_vit16")[0]
    assert max_rel_diff(losses, ref) < 1e-5, (losses, ref)
