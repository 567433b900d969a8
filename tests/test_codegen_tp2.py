"""Generated code under tp=2 (tier 2, golden): one module per chunk for every tp rank, each
line annotated with its source module, placement and local shape, names from the model.

After an intended change to the generator, rewrite the files with
THREEFOLD_UPDATE_GOLDEN=1 python -m pytest tests/test_codegen_tp2.py, and read the diff.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from tests.foundation_helpers import workload
from threefold.codegen.artifact import build_sources, save_artifact
from threefold.compiler.api import compile_workload
from threefold.runtime.loader import load_chunk, open_artifact

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "gpt_tiny_tp2_pp2")
UPDATE = os.environ.get("THREEFOLD_UPDATE_GOLDEN") == "1"
TINY = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=2)


@pytest.fixture(scope="module")
def tp2_prog():
    return compile_workload(workload("gpt", **TINY), "tp=2,pp=2")


@pytest.fixture(scope="module")
def tp2_sources(tp2_prog):
    return build_sources(tp2_prog)


def test_tp2_generated_code_matches_golden(tp2_sources):
    assert sorted(tp2_sources) == ["chunk00.py", "chunk01.py"]   # one module per chunk, not per tp rank
    for name, text in tp2_sources.items():
        path = os.path.join(GOLDEN, name)
        if UPDATE:
            os.makedirs(GOLDEN, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        with open(path) as f:
            assert text == f.read(), (f"{name} differs from tests/golden/gpt_tiny_tp2_pp2/{name}; if the "
                                      "change is intended, rerun with THREEFOLD_UPDATE_GOLDEN=1 and review the diff")


def _op_lines(text: str) -> list[str]:
    """First lines of the statements in forward that compute a value (not parameter reads)."""
    body = text.split("    def forward(", 1)[1]
    return [ln for ln in body.splitlines()[1:]
            if re.match(r"^        \w+ = ", ln) and "= self.p(" not in ln and "= self.device" not in ln]


def test_every_computing_line_names_module_placement_and_local_shape(tp2_sources):
    for name, text in tp2_sources.items():
        lines = _op_lines(text)
        assert len(lines) > 20, name
        for ln in lines:
            m = re.search(r"  # (\S+)  (R|R\(f\)|R\*|P|S\(.*?\)|\(.*\))  (\[[\d, ]*\]|\(.*\))", ln)
            assert m, f"{name}: no 'module  placement  shape' comment on: {ln}"
        assert max(len(ln) for ln in text.splitlines()) <= 120, f"{name}: a generated line is too long"
    text = tp2_sources["chunk00.py"]
    # the column-parallel projection: this rank's third of each of q, k, v (local shape 24 = 3 * 16 / 2)
    assert ("h0_attn_c_attn_linear = aten.linear.default(  # h.0.attn.c_attn  S(2,blocks=[16, 16, 16])  "
            "[2, 8, 24]") in text
    # the row-parallel projection: a partial sum, reduced by g, then the bias added once
    assert "h0_attn_c_proj_linear = aten.linear.default(  # h.0.attn.c_proj  P  [2, 8, 16]" in text
    assert "h0_attn_c_proj_g = tp_ops.g(h0_attn_c_proj_linear, self.tp_group)  # h.0.attn.c_proj  R" in text
    assert "h0_attn_c_proj_add = aten.add.Tensor(h0_attn_c_proj_g, p_h_0_attn_c_proj_bias)" in text
    assert "h0_ln_1 = aten.layer_norm.default(  # h.0.ln_1  R  [2, 8, 16]" in text   # a leaf's only op
    # names come from the model, not from the op or fx's counter
    assert not re.search(r"^\s+(linear|linear_\d+|linear_default|add_\d+|getitem(_\d+)?) = ", text, re.M)
    # the boundary value keeps its wire name in OUTPUTS; the return line says which it is
    assert "return (h0_add_1, )  # OUTPUTS ['add_2']" in text


def test_tp2_artifact_one_module_shared_weights_per_rank(tp2_prog, tp2_sources, tmp_path):
    art = save_artifact(tp2_prog, str(tmp_path / "art"), sources=tp2_sources)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    for c in manifest["chunks"]:
        assert c["module"] == f"chunk{c['index']:02d}.py" and "modules" not in c
        assert sorted(c["weights"]) == ["0", "1"]              # weight shards stay per tp rank
        assert c["module"] in manifest["files"] and all(w in manifest["files"] for w in c["weights"].values())
    assert sorted(os.listdir(tmp_path / "art")) == [".threefold-out.json", "chunk00.py", "chunk01.py",
                                                    "manifest.json", "weights"]
    art.verify()   # every listed file matches its sha256
    r0, r1 = load_chunk(art, 0, tp_rank=0), load_chunk(art, 0, tp_rank=1)
    assert type(r0) is type(r1)                                 # one class for both ranks...
    w0, w1 = r0.p("h.0.attn.c_attn.weight"), r1.p("h.0.attn.c_attn.weight")
    assert w0.shape == w1.shape == (24, 16) and not w0.equal(w1)   # ...each with its own shard
    # an edited shared module is refused for every rank
    with open(tmp_path / "art" / "chunk00.py", "a") as f:
        f.write("# edited\n")
    with pytest.raises(Exception, match="does not match its sha256"):
        load_chunk(open_artifact(str(tmp_path / "art")), 0, tp_rank=1)


def test_shared_kernel_lists_every_region_it_serves():
    prog = compile_workload(workload("gpt", **TINY), "tp=2,pp=2,fuse=true")
    text = build_sources(prog)["kernels.py"]
    banner = text.split("# bias_dropout_add:", 1)[1].split("# inputs:", 1)[0]
    # two blocks x (attention residual, MLP residual): one kernel, four regions, each listed
    assert "# serves 4 regions (source nodes of each):" in banner
    assert len(re.findall(r"^#   \d: ", banner, re.M)) == 4


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_shared_tp_module_trains_like_one_process(tmp_path):
    """The one module per chunk, loaded by both tp ranks of each stage (tied embedding across
    stages, scatter/gather boundaries), trains like the original in `threefold run`."""
    import subprocess
    import sys
    from tests.parity import load_workload, max_rel_diff, reference_losses
    kw = {"n_layer": 2, "n_embd": 16, "n_head": 2, "seq": 8, "batch": 4}
    w = load_workload("gpt", **kw)
    save_artifact(compile_workload(w, "tp=2,pp=2,m=2"), str(tmp_path / "art"), batch=(*w["inputs"], w["target"]))
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(tmp_path / "art"), "--json"],
                         cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=""), capture_output=True,
                         text=True, timeout=350)
    assert out.returncode == 0, out.stderr
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    ref = reference_losses("gpt", kw, len(losses))
    assert len(losses) >= 2 and max_rel_diff(losses, ref) < 1e-5, (losses, ref)
