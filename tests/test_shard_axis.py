"""Adding an axis is 4 places (docs/design.md, "How to add an axis"): its mesh entry, its plan
field, its rules module, its runtime ops. The worked example: a toy axis that splits the
batch rows of a pointwise model, registered at test time (the mesh entry and the plan field
here; tests/toy_axis_rules.py; tests/toy_axis_ops.py), compiled by the unchanged compiler."""
from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
import torch

from threefold.codegen.artifact import build_manifest, build_sources
from threefold.compiler.api import compile_workload
from threefold.errors import PlanError
from threefold.placement import P, Shard, on_mesh_of
from threefold.plan import Plan
from threefold.runtime import mesh
from threefold.runtime.run_plan import InputSplit, input_cut

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# 1. the plan field
@dataclasses.dataclass(frozen=True)
class ToyPlan(Plan):
    toy: int = 1


# 2. the mesh entry: its rules module (3) and its runtime op that cuts user inputs (4)
TOY = mesh.Axis("toy", lambda plan: getattr(plan, "toy", 1), "a toy axis: the batch rows of pointwise models",
                optional=True, rules="tests.toy_axis_rules", cut="tests.toy_axis_ops:rows")


@pytest.fixture
def toy_axis(monkeypatch):
    monkeypatch.setattr(mesh, "AXES", mesh.AXES[:-1] + (TOY, mesh.AXES[-1]))   # inside cp, outside tp
    input_cut.cache_clear()
    yield
    input_cut.cache_clear()


class _Pointwise(torch.nn.Module):
    def __init__(self, mix: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((8,), 0.5))
        self.mix = mix

    def forward(self, x):
        y = torch.tanh(x) * self.w
        return torch.softmax(y, dim=0) if self.mix else y


def _workload(mix: bool = False):
    torch.manual_seed(0)
    return dict(model=_Pointwise(mix), inputs=(torch.randn(4, 8),), target=torch.randn(4, 8),
                loss_fn=lambda y, t: ((y - t) ** 2).sum())


def test_a_toy_axis_places_every_value_and_the_manifest_carries_it(toy_axis):
    prog = compile_workload(_workload(), ToyPlan(toy=2))
    nodes = [n for _, n in prog.chunk_nodes()]
    inputs = [n for n in nodes if n.op == "placeholder" and n.meta["tf"]["kind"] == "input"]
    assert len(inputs) == 2 and all(on_mesh_of(n)["toy"] == Shard(0) for n in inputs)
    tanh = [n for n in nodes if n.op == "call_function" and "tanh" in str(n.target)]
    assert tanh and on_mesh_of(tanh[0])["toy"] == Shard(0)
    loss = [n for n in nodes if n.op == "output"][-1].args[0]
    loss = loss[0] if isinstance(loss, (list, tuple)) else loss
    assert on_mesh_of(loss)["toy"] == P
    params = [n for n in nodes if n.op == "placeholder" and n.meta["tf"]["kind"] == "param"]
    assert params and all(on_mesh_of(n)["toy"] != Shard(0) for n in params)
    manifest = build_manifest(prog, build_sources(prog), {}, with_weights=False)
    # the runtime cuts each input by the toy axis's own op, read from the mesh entry
    assert manifest.input_splits == (InputSplit(None, (("toy", 0),)),) * 2
    x = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(input_cut("toy")(x, 0, 2, 1), x[2:])


def test_a_toy_axis_refusal_is_the_walkers_one_line(toy_axis):
    with pytest.raises(PlanError, match=r"^toy=2: softmax at <top> has no toy rule; use toy=1$"):
        compile_workload(_workload(mix=True), ToyPlan(toy=2))


def test_the_toy_axis_needed_nothing_in_the_package():
    """The 4 places are all the axis touched: no file of threefold/ names it."""
    out = subprocess.run(["grep", "-rlw", "toy", os.path.join(ROOT, "threefold")], capture_output=True, text=True)
    assert out.stdout == ""


def test_every_sharding_axis_is_applied_by_the_walker_and_the_pipeline_names_none():
    """tp, cp, ep and the batch axes all reach the graph through passes/shard.py's three
    phases: the pass list names the phases, never an axis, and each axis's rules module
    gives the walker its AxisRules."""
    import importlib
    from threefold.compiler.pipeline import default_passes
    from threefold.passes.shard import AxisRules, shard, shard_chunks, shard_local
    passes = default_passes()
    assert [p for p in passes if p in (shard_local, shard, shard_chunks)] == [shard_local, shard, shard_chunks]
    names = {getattr(p, "__name__", "") for p in passes}
    assert not names & {"tensor_parallel", "context_parallel", "place_batch_axes", "place_expert_axis"}, names
    for axis in mesh.AXES:
        if axis.name == "pp":   # the pipeline cut is a pass of its own (split_pipeline), not a placement
            continue
        rules = importlib.import_module(axis.rules).SHARDING
        assert rules and all(isinstance(r, AxisRules) for r in rules), axis.name
    tp_rules, = importlib.import_module(mesh.AXES[-1].rules).SHARDING
    assert (tp_rules.axis, tp_rules.phase) == ("tp", "local")
