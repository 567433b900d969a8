"""Codegen and artifacts: golden generated code, reload in a fresh process, debug dumps, runner."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import threefold
from tests.foundation_helpers import ROOT, workload
from threefold.codegen.artifact import build_sources, save_artifact
from threefold.codegen.python import content_hash
from threefold.compiler.api import compile_workload
from threefold.passes.cost import annotate_costs
from threefold.ir.contracts import stage_pass
from threefold.compiler.pipeline import PassFailed, default_passes, run_passes
from threefold.ir.stage_io import load_stage
from threefold.ir.stages import Partitioned, Sharded, Traced, copy_graph_module
from threefold.compiler.trace import trace
from threefold.passes.pipeline_split import split_pipeline
from threefold.passes.tensor_parallel import tensor_parallel

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "gpt_tiny_pp2")
UPDATE = os.environ.get("THREEFOLD_UPDATE_GOLDEN") == "1"
TINY = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=2)


def _golden(name: str, text: str) -> None:
    path = os.path.join(GOLDEN, name)
    if UPDATE:
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        expected = f.read()
    assert text == expected, (f"{name} differs from tests/golden/gpt_tiny_pp2/{name}; if the change "
                              "is intended, rerun with THREEFOLD_UPDATE_GOLDEN=1 and review the diff")


@pytest.fixture(scope="module")
def tiny_prog():
    return compile_workload(workload("gpt", **TINY), "pp=2")


def test_generated_code_matches_golden(tiny_prog):
    sources = build_sources(tiny_prog)
    assert sorted(sources) == ["chunk00.py", "chunk01.py"]
    for name, text in sources.items():
        _golden(name, text)


def test_inspect_json_matches_golden(tiny_prog):
    from threefold.cli.inspect_cmd import chunk_report
    _golden("inspect.json", json.dumps(chunk_report(tiny_prog), indent=2) + "\n")


def test_generated_header_and_names(tiny_prog):
    text = build_sources(tiny_prog)["chunk01.py"]
    header = text.split('"""')[1]
    assert "plan:    tp=1,pp=2" in header and "pipeline stage 1" in header and "every tp rank of 1" in header
    assert "covers:  h.1" in header and "lm_head" in header
    assert content_hash(text) and len(content_hash(text)) == 16
    # parameters under their original FQNs; value names from the model's modules
    assert "'h.1.attn.c_attn.weight': ([48, 16], 'float32')" in text
    assert "'wte.weight'" in text  # the tied LM head reads the embedding's weight
    assert "= aten.linear.default(" in text and "cross_entropy_loss = aten.cross_entropy_loss" in text
    assert "lm_head = aten.linear.default(ln_f, p_wte_weight)  # lm_head  R  [2, 8, 32]" in text
    assert "def forward(self, add_2, target):" in text  # boundary value, then the batch's target
    assert "USER_INPUTS = [1]" in text


def test_content_hash_changes_with_the_code(tiny_prog):
    a = build_sources(tiny_prog)
    b = build_sources(compile_workload(workload("gpt", **{**TINY, "n_embd": 32}), "pp=2"))
    assert content_hash(a["chunk00.py"]) != content_hash(b["chunk00.py"])


_FRESH = r"""
import sys
sys.modules["examples"] = None   # the model's source cannot be imported here
import torch
from threefold.runtime.loader import load_chunk, open_artifact
art = open_artifact(sys.argv[1])
batch = torch.load(sys.argv[2])
values = ()
for i in range(len(art.chunks)):
    mod = load_chunk(art, i)
    values = mod(*values, *(batch[j] for j in mod.USER_INPUTS))
leaked = [m for m in sys.modules if m.startswith(("threefold.compiler", "threefold.passes",
                                                   "threefold.codegen", "examples."))]
assert not leaked, leaked
print(repr(values[0].item()))
"""


@pytest.mark.parametrize("plan", ["pp=3", "pp=2,v=2,schedule=interleaved"])
def test_artifact_reloads_in_a_fresh_process(tmp_path, plan):
    w = workload("gpt", n_layer=4)
    prog = compile_workload(w, plan)
    art = save_artifact(prog, str(tmp_path / "art"))
    manifest = art.manifest
    assert manifest["plan"] == str(threefold.Plan.parse(plan))
    assert manifest["chunks"][0]["shared_params"] == {"wte.weight": [0, len(prog.chunks) - 1]}
    assert all(os.path.isfile(os.path.join(art.root, c["weights"]["0"])) for c in manifest["chunks"])
    batch_file = tmp_path / "batch.pt"
    torch.save(tuple(w["inputs"]) + (w["target"],), batch_file)
    script = tmp_path / "fresh.py"
    script.write_text(_FRESH)
    out = subprocess.run([sys.executable, str(script), art.root, str(batch_file)], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-2000:]
    ref = w["loss_fn"](w["model"](*w["inputs"]), w["target"]).item()
    assert float(out.stdout.strip()) == pytest.approx(ref, rel=1e-6)


def test_meta_model_artifact_has_no_weights(tmp_path):
    prog = compile_workload(workload("gpt", n_layer=2, n_embd=1024, n_head=16, seq=64, batch=1,
                                     device="meta"), "pp=2")
    art = save_artifact(prog, str(tmp_path / "art"))
    assert not os.path.exists(os.path.join(art.root, "weights"))
    assert all(c.weights == {} for c in art.chunks) and not art.manifest.has_weights


def test_debug_dir_gets_every_pass_and_generated_file(tmp_path, monkeypatch):
    monkeypatch.setenv("THREEFOLD_DEBUG_DIR", str(tmp_path))
    prog = compile_workload(workload("gpt", **TINY), "pp=2")
    build_sources(prog)
    files = sorted(os.listdir(tmp_path))
    assert "00_traced.txt" in files and isinstance(load_stage(str(tmp_path / "00_traced")), Traced)
    for i, p in enumerate(default_passes(), start=1):
        assert f"{i:02d}_{p.__name__}.txt" in files
        assert type(load_stage(str(tmp_path / f"{i:02d}_{p.__name__}"))).__name__ == p.spec.gives.__name__ \
            or isinstance(load_stage(str(tmp_path / f"{i:02d}_{p.__name__}")), p.spec.gives)
    last = load_stage(str(tmp_path / f"{len(default_passes()):02d}_{default_passes()[-1].__name__}"))
    assert build_sources(last) == build_sources(prog)   # the dump is the real stage
    assert {"chunk00.py", "chunk01.py"} <= set(files)
    assert "%p_wte_weight = param wte.weight" in (tmp_path / "00_traced.txt").read_text()


def test_runner_names_the_failing_pass_and_those_before():
    w = workload("gpt", n_layer=1)
    prog = trace(w["model"], w["inputs"], w["target"], w["loss_fn"])

    def breaks_things(p):
        raise RuntimeError("boom")

    with pytest.raises(PassFailed, match=r"pass breaks_things failed after \[annotate_costs\]: RuntimeError: boom"):
        run_passes(prog, [annotate_costs, breaks_things])


def test_runner_checks_invariants_after_each_pass():
    w = workload("gpt", n_layer=1)
    prog = trace(w["model"], w["inputs"], w["target"], w["loss_fn"])

    def drops_shapes(p):
        gm = copy_graph_module(p.gm)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.meta.pop("val", None)
                break
        return p.evolve(gm=gm)

    with pytest.raises(PassFailed, match="pass drops_shapes failed after \\[\\]: ContractError: program: node .* has no shape"):
        run_passes(prog, [drops_shapes])


def test_runner_fails_a_pass_that_changes_its_input():
    w = workload("gpt", n_layer=1)
    prog = trace(w["model"], w["inputs"], w["target"], w["loss_fn"])

    def edits_in_place(p):
        next(n for n in p.graph.nodes if n.op == "call_function").meta["tf"]["module"] = "elsewhere"
        return p.evolve()

    with pytest.raises(PassFailed, match="pass edits_in_place failed after \\[\\]: it changed its input stage in place"):
        run_passes(prog, [edits_in_place])


def test_runner_checks_declared_stage_types_and_guarantees():
    w = workload("gpt", n_layer=1)
    prog = trace(w["model"], w["inputs"], w["target"], w["loss_fn"], threefold.Plan(pp=2))
    with pytest.raises(PassFailed, match="pass split_pipeline failed after \\[\\]: needs a Sharded stage, got Traced"):
        run_passes(prog, [split_pipeline])

    @stage_pass(needs=Traced, gives=Sharded)
    def forgets_to_advance(p):
        return p.evolve()
    with pytest.raises(PassFailed, match="forgets_to_advance failed .*returned Traced, but declares Sharded"):
        run_passes(prog, [forgets_to_advance])

    @stage_pass(needs=Traced, guarantees=("costs",))
    def claims_costs(p):
        return p.evolve()
    with pytest.raises(PassFailed, match="claims_costs failed .*ContractError: node .* has no cost"):
        run_passes(prog, [claims_costs])
    sharded = run_passes(prog, [tensor_parallel])
    with pytest.raises(PassFailed, match="split_pipeline failed .*does not satisfy 'costs'"):
        run_passes(sharded, [split_pipeline])
    assert isinstance(run_passes(sharded, [annotate_costs, split_pipeline]), Partitioned)


def test_layering_example_models_import_nothing_from_threefold():
    # the example models are plain PyTorch that users copy from: no threefold imports
    # (examples/gpt.py's model lives in threefold/models/gpt.py, which the main job trains)
    for path in (("threefold", "models", "gpt.py"), ("examples", "hf.py")):
        with open(os.path.join(ROOT, *path)) as f:
            assert "threefold" not in f.read().split('"""', 2)[-1]


def test_debug_dir_under_cp_saves_every_stage(tmp_path, monkeypatch):
    """A cp compile's stages carry `retrace` (a closure over the model, for the masks): the dump
    leaves it out instead of failing to pickle it."""
    monkeypatch.setenv("THREEFOLD_DEBUG_DIR", str(tmp_path))
    compile_workload(workload("gpt", **TINY), "cp=2")
    traced = load_stage(str(tmp_path / "00_traced"))
    assert isinstance(traced, Traced) and traced.retrace is None
