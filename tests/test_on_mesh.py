"""One placement per mesh axis on every tensor (threefold/placement.OnMesh): each axis's pass
fills its entry (tp, cp, the batch axes, ep, dp_shard under zero=3), and the manifest, the
runtime's input split, the memory model and inspect read them (compile only, no ranks)."""
import hashlib
import json

import pytest
import torch

import threefold
from threefold.cli.inspect_params import parameter_rows
from threefold.codegen.artifact import build_manifest, build_sources
from threefold.compiler.api import compile_workload
from threefold.ir.stage_io import stage_from_bytes, stage_to_bytes
from threefold.placement import OnMesh, P, Shard, on_mesh_of, parse_on_mesh
from threefold.runtime.manifest import FORMAT, Manifest
from threefold.runtime.run_plan import InputSplit
from tests.parity import load_workload

GPT = dict(n_layer=2, n_embd=32, n_head=2, seq=16, batch=4)


def _compile(plan: str, workload=None):
    torch.manual_seed(0)
    prog = compile_workload(workload or load_workload("gpt", **GPT), plan)
    sources = build_sources(prog)
    hashes = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sources.items()}
    manifest = Manifest.from_json(json.loads(build_manifest(prog, sources, hashes, False).dumps()))
    return prog, manifest


def _nodes(prog):
    return [n for _, n in prog.chunk_nodes()]


def test_on_mesh_text_round_trips_and_says_each_axis_dim():
    on = OnMesh.of(tp=Shard(1), cp=Shard(2), dp=Shard(0), ep=P)
    assert parse_on_mesh(str(on)) == on and str(OnMesh.of(tp=Shard(1))) == "S(1)"
    assert (on.dim("tp"), on.dim("cp"), on.dim("dp"), on.dim("ep"), on.dim("pp")) == (1, 2, 0, None, None)
    assert InputSplit.of(on) == InputSplit(batch=0, cuts=(("cp", 2),)) and InputSplit.of(on).seq == 2


def test_tp2_cp2_fills_tp_and_cp_and_the_runtime_cuts_inputs_by_them():
    prog, manifest = _compile("tp=2,cp=2")
    nodes = _nodes(prog)
    inputs = [n for n in nodes if n.op == "placeholder" and n.meta["tf"]["kind"] == "input"]
    assert inputs and all(on_mesh_of(n)["cp"] == Shard(1) for n in inputs)
    rings = [n for n in nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "ring_attention"]
    assert len(rings) == 2 and all(isinstance(on_mesh_of(n)["cp"], Shard) for n in rings)
    # every value computed from the sequence before the loss is along it or a partial sum of it
    loss = [n for n in nodes if n.op == "output"][-1].args[0]
    loss = loss[0] if isinstance(loss, (list, tuple)) else loss
    assert on_mesh_of(loss)["cp"] == P
    assert sum(isinstance(on_mesh_of(n)["cp"], Shard) for n in nodes) > 20
    # tp placed the weights and the activations between its column and row matmuls
    assert any(isinstance(on_mesh_of(n)["tp"], Shard) and isinstance(on_mesh_of(n)["cp"], Shard) for n in nodes)
    assert manifest.param_on_mesh("h.0.mlp.c_fc.weight")["tp"] == Shard(0)
    # the manifest's inputs carry the placements; the runtime reads one split per input
    assert manifest.input_splits == (InputSplit(None, (("cp", 1),)), InputSplit(None, (("cp", 1),)))
    assert "seq_dims" not in manifest.to_json() and manifest.to_json()["format"] == FORMAT


def test_dp2_ep2_fills_the_batch_rows_and_the_experts():
    from tests.zoo import ZOO
    torch.manual_seed(1234)
    prog, manifest = _compile("dp=2,ep=2", ZOO["mixtral"]())
    nodes = _nodes(prog)
    inputs = [n for n in nodes if n.op == "placeholder" and n.meta["tf"]["kind"] == "input"]
    assert inputs and all(on_mesh_of(n)["dp"] == Shard(0) for n in inputs)
    assert sum(isinstance(on_mesh_of(n)["dp"], Shard) for n in nodes) > 20   # rows followed through the graph
    experts = set(manifest.experts)
    assert experts and manifest.sharded_over("ep") == experts
    assert all(manifest.param_on_mesh(f)["ep"] == Shard(0) for f in experts)
    regions = [(c, r) for c in prog.chunks for r in c.experts]
    assert regions
    for chunk, r in regions:
        by_name = {n.name: n for n in chunk.gm.graph.nodes}
        assert all(on_mesh_of(by_name[x])["ep"] == Shard(0) for x in r["nodes"] + r["weights"])
    dense = [f for f in manifest.state_shapes if f not in experts]
    assert dense and not any(manifest.param_on_mesh(f).dim("ep") is not None for f in dense)
    assert manifest.input_splits == (InputSplit(0), InputSplit(0))
    rows = {r["fqn"]: r for r in parameter_rows(prog)}   # inspect --json's parameters
    assert all(rows[f]["axes"] == {"ep": "S(0)"} for f in experts) and "axes" not in rows[dense[0]]


def test_fsdp_fills_dp_shard_on_every_trainable_parameter_and_stages_keep_it():
    prog, manifest = _compile("dp=2,zero=3")
    params = [n for n in _nodes(prog) if n.op == "placeholder" and n.meta["tf"]["kind"] == "param"]
    assert params and all(on_mesh_of(n)["dp_shard"] == Shard(0) for n in params)
    assert set(manifest.sharded_over("dp_shard")) == {n.meta["tf"]["fqn"] for n in params}
    again = stage_from_bytes(stage_to_bytes(prog))   # a saved stage keeps its placements
    assert [str(on_mesh_of(n)) for _, n in again.chunk_nodes()] == [str(on_mesh_of(n)) for n in _nodes(prog)]


def test_an_artifact_of_the_previous_format_is_a_one_line_recompile_error():
    _, manifest = _compile("dp=2")
    old = dict(manifest.to_json(), format=FORMAT - 1, seq_dims=None)
    with pytest.raises(threefold.PlanError, match="recompile") as err:
        Manifest.from_json(old)
    assert "\n" not in str(err.value)
