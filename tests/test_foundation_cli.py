"""`threefold inspect` and `threefold compile`, and their one-line errors with exit code 2."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.foundation_helpers import ROOT
from threefold.cli.main import main

GPT = os.path.join(ROOT, "examples", "gpt.py")
TINY = f"{GPT}:workload(n_layer=2,n_embd=16,n_head=2,vocab_size=32,seq=8,batch=2)"


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_table(capsys):
    code, out, err = _run(capsys, "inspect", f"{GPT}:workload", "--plan", "pp=4")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("GPT  plan: tp=1,pp=4")
    header = lines[1].split()
    assert header[:5] == ["chunk", "stage", "ranks", "ops", "params"]
    assert "activations" in lines[1] and "boundary in" in lines[1] and "boundary out" in lines[1]
    assert len([ln for ln in lines if ln.strip().split(" ")[0].isdigit()]) == 4
    assert any(ln.startswith("FLOPs imbalance (max/mean): ") for ln in lines)
    assert "wte.weight" in out  # the tied weight held by first and last chunk


def test_inspect_json_schema(capsys):
    code, out, _ = _run(capsys, "inspect", TINY, "--plan", "pp=2,dp=2,tp=1", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"plan", "chunks", "imbalance", "parameters", "mesh", "step_collectives"}
    assert report["mesh"] == [["pp", 2], ["dp_replicate", 1], ["dp_shard", 2], ["tp", 1]]
    # each stage's verified step schedule holds its gradient all-reduces and their wait
    assert all("wg" in acts and any(a.startswith("ar") for a in acts) for acts in report["step_collectives"])
    assert report["plan"] == "tp=1,pp=2,dp=2,m=1,v=1,schedule=1f1b"
    params = {p["fqn"]: p for p in report["parameters"]}   # tp=1: every parameter whole
    assert params and all(p["placement"] == "R" and p["local_shape"] == p["shape"] for p in params.values())
    assert params["wte.weight"]["chunks"] == [0, 1]      # tied: held by the first and last chunk
    keys = {"index", "stage", "ranks", "ops", "params", "flops", "activation_bytes",
            "boundary_in_bytes", "boundary_out_bytes", "collectives"}
    assert [set(c) for c in report["chunks"]] == [keys, keys]
    assert [c["ranks"] for c in report["chunks"]] == [[0, 1], [2, 3]]  # rank = tp + tp*(dp + dp*pp)
    first, last = report["chunks"]
    assert first["boundary_in_bytes"] == 0 and first["boundary_out_bytes"] == last["boundary_in_bytes"] > 0
    assert last["boundary_out_bytes"] == 0
    assert report["imbalance"] >= 1.0


def test_inspect_interleaved_stages(capsys):
    code, out, _ = _run(capsys, "inspect", TINY, "--plan", "pp=2,v=2,schedule=interleaved", "--json")
    assert code == 0
    assert [c["stage"] for c in json.loads(out)["chunks"]] == [0, 1, 0, 1]


def test_inspect_graph(capsys):
    code, out, _ = _run(capsys, "inspect", TINY, "--plan", "pp=2", "--graph")
    assert code == 0
    assert "chunk 0:" in out and "chunk 1:" in out
    assert "%idx = input idx" in out and "%add_2 = boundary" in out
    assert "aten.cross_entropy_loss.default" in out


def test_compile_writes_an_artifact(capsys, tmp_path):
    out_dir = tmp_path / "art"
    code, out, err = _run(capsys, "compile", TINY, "--plan", "pp=2", "--out", str(out_dir))
    assert code == 0, err
    assert out.startswith("compiled GPT for plan tp=1,pp=2")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["num_chunks"] == 2 and manifest["plan"].startswith("tp=1,pp=2")
    assert sorted(os.listdir(out_dir)) == [".threefold-out.json", "batch.safetensors", "chunk00.py",
                                           "chunk01.py", "manifest.json", "weights"]
    code, out, _ = _run(capsys, "compile", TINY, "--plan", "pp=2", "--out", str(out_dir), "--json",
                        "--no-weights")
    assert code == 0 and json.loads(out)["weights"] is False
    assert not (out_dir / "weights").exists()


BAD_MODEL = textwrap.dedent('''
    import torch

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:
                y = y * 2
            return y

    def workload():
        return {"model": Branchy(), "inputs": (torch.randn(2, 4),)}
''')


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "{bad}:workload"], "cannot trace Branchy"),
    (["inspect", "{gpt}:workload(n_layer=1)", "--plan", "pp=200"], "pp*v=200"),
    (["inspect", "{gpt}", "--plan", "pp=2"], "malformed"),
    (["inspect", "{gpt}:no_such_factory"], "no callable named"),
    (["inspect", "{gpt}:workload(n_layer=)"], "factory arguments"),
    (["inspect", "missing.py:workload"], "does not exist"),
    (["inspect", "{gpt}:workload", "--plan", "pp=two"], "pp='two'"),
    (["inspect", "{gpt}:workload", "--plan", "pp"], "malformed"),
    (["inspect", "{gpt}:workload", "--plan", "pp=2,bogus=1"], "plan key 'bogus' is unknown"),
    (["compile", "{gpt}:workload", "--plan", "pp=2,bogus=1", "--out", "{tmp}/x"], "plan key 'bogus'"),
    (["compile", "{bad}:workload", "--out", "{tmp}/x"], "if y.sum() > 0:"),
    (["inspect", "{gpt}:workload", "--plan", "split=h.9,pp=2"], "names no module"),
])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, argv, needle):
    bad = tmp_path / "bad_model.py"
    bad.write_text(BAD_MODEL)
    argv = [a.format(bad=bad, gpt=GPT, tmp=tmp_path) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"threefold {argv[0]}: error: "), err
    assert needle in err
    assert "Traceback" not in err and out == ""
