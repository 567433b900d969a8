"""The typed Manifest (runtime/manifest.py): one value from the compiler to every rank."""
from __future__ import annotations

import json

import pytest

from tests.foundation_helpers import workload
from threefold.codegen.artifact import build_manifest, build_sources
from threefold.compiler.api import compile_workload
from threefold.errors import PlanError
from threefold.placement import Replicate, Shard
from threefold.plan import Plan
from threefold.runtime.manifest import Manifest
from threefold.runtime.run_plan import RunPlan
from threefold.runtime.shard import ShardSpec

TINY = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=4)


@pytest.fixture(scope="module")
def manifest():
    prog = compile_workload(workload("gpt", **TINY), "tp=2,pp=2,m=2")
    m = build_manifest(prog, build_sources(prog), {}, with_weights=False)
    # a JSON form must list every file it names: give the modules their (fake) hashes
    return m.replace(files={c.module: "0" * 64 for c in m.chunks})


def test_json_round_trip_gives_the_same_value(manifest):
    again = Manifest.loads(manifest.dumps())
    assert again == manifest
    assert isinstance(again.plan, RunPlan) and str(again.plan) == str(manifest.plan)
    assert again.plan == RunPlan.of(Plan.parse(str(manifest.plan)))   # the values, not only the text
    assert again.mesh.world_size == 4 and again.local_chunks(1) == [1]
    assert all(isinstance(s, ShardSpec) for s in again.shards.values()) and again.shards
    placements = [s.placement for c in again.chunks for s in c.inputs + c.outputs]
    assert all(isinstance(p, (Replicate, Shard)) for p in placements)
    assert again.loss.denominator == "graph" and not again.model_outputs_missing


def test_dict_style_reads_see_the_json_form(manifest):
    assert manifest["plan"] == str(manifest.plan)
    assert manifest["chunks"][1]["class"] == "Chunk1"
    assert manifest.get("shards")["wte.weight"] == manifest.shards["wte.weight"].to_json()
    assert manifest.get("no such key", 7) == 7


def test_unknown_keys_survive_and_missing_new_keys_read_as_old(manifest):
    data = manifest.to_json()
    data["from_a_newer_writer"] = {"x": 1}
    del data["model_outputs_missing"]
    m = Manifest.from_json(json.loads(json.dumps(data)))
    assert m.extra == {"from_a_newer_writer": {"x": 1}} and m.to_json()["from_a_newer_writer"] == {"x": 1}
    assert "recompile" in m.model_outputs_missing   # an old artifact: pm(x) says what to do


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["mesh"].__setitem__(-1, ["tp", 1]), "is not plan"),
    (lambda d: d["schedule"].__setitem__("microbatches", 4), "is not plan"),
    (lambda d: d["plan_values"].__setitem__("tp", "two"), "invalid plan value"),
    (lambda d: d.pop("plan_values"), "no plan values"),
    (lambda d: d["chunks"][0].pop("params"), None),
])
def test_inconsistent_json_is_one_plan_error(manifest, edit, message):
    data = json.loads(manifest.dumps())
    edit(data)
    if message is None:                      # a missing optional field reads as empty
        assert Manifest.from_json(data).chunks[0].params == ()
        return
    with pytest.raises(PlanError, match=message):
        Manifest.from_json(data)
