"""The tensor-parallel rules are pure: asked about one call (its inputs' placements and local
values), a rule returns a decision and leaves the graph as it was. Unit tier (no ranks)."""
import torch
import torch.fx as fx

from threefold.ops.families import args_of, op_name
from threefold.ops.rules import NoRule
from threefold.passes.tp_decisions import REDUCE, REGISTRY, TpCall, TpDecision
from threefold.passes.tp_placement import Partial, Replicate, Shard
from threefold.passes.tp_redistribute import ENTER, Cut
from threefold.passes.tp_rules import elementwise

aten = torch.ops.aten


def _graph(target, shapes, *extra, kwargs=None, out_shape=None):
    """A one-call graph: placeholders of `shapes` (meta values) fed to `target`."""
    g = fx.Graph()
    ins = []
    for i, s in enumerate(shapes):
        p = g.placeholder(f"x{i}")
        p.meta["val"] = torch.empty(s, device="meta")
        ins.append(p)
    node = g.call_function(target, tuple(ins) + extra, kwargs or {})
    node.meta["val"] = target(*[i.meta["val"] for i in ins], *extra, **(kwargs or {})) if out_shape is None \
        else torch.empty(out_shape, device="meta")
    g.output(node)
    return g, node, ins


def _ask(node, places, t=2):
    """The registry's decision, given each input's placement (local values cut accordingly)."""
    locals_ = {}
    for a, p in places.items():
        shape = list(a.meta["val"].shape)
        if isinstance(p, Shard):
            shape[p.dim] //= t
        locals_[a] = torch.empty(shape, device="meta")
    call = TpCall(node, op_name(node), args_of(node), t, places, locals_)
    return REGISTRY.decide(op_name(node), node, call)


def test_a_rule_decides_without_touching_the_graph():
    g, node, (x,) = _graph(aten.transpose.int, [(4, 8, 6)], 1, 2)
    before = [(n.name, n.target, n.args) for n in g.nodes]
    d = _ask(node, {x: Shard(2)})
    assert isinstance(d, TpDecision) and d.out == Shard(1) and d.op is None and not d.needs
    assert [(n.name, n.target, n.args) for n in g.nodes] == before


def test_a_sum_over_the_shard_is_a_partial_sum_then_an_all_reduce():
    g, node, (x,) = _graph(aten.sum.dim_IntList, [(4, 8)], [1])
    d = _ask(node, {x: Shard(1)})
    assert d.op.target is aten.sum.dim_IntList and d.op.place == Partial() and d.then == (REDUCE,)
    assert d.out == Replicate()


def test_pointwise_asks_to_cut_a_whole_operand_and_to_enter_a_broadcast_one():
    g, node, (a, b) = _graph(aten.add.Tensor, [(4, 8), (4, 8)])
    d = _ask(node, {a: Shard(1), b: Replicate()})
    assert d.out == Shard(1) and d.needs == {b: Cut(1, Shard(1))} and d.skip == {b}
    g, node, (a, w) = _graph(aten.mul.Tensor, [(4, 8), (1, 8)])
    d = _ask(node, {a: Shard(0), w: Replicate()})
    assert d.needs == {w: ENTER} and d.uses == "sharded"


def test_no_rule_says_why():
    g, node, (x,) = _graph(aten._softmax.default, [(4, 8)], 1, False)
    d = _ask(node, {x: Shard(1)})
    assert isinstance(d, NoRule) and "normalises over the sharded dim" in d.why


def test_a_family_member_needs_no_rule_of_its_own():
    """logaddexp has no tp rule by name: ATen tags it pointwise, so the family's rule runs it.
    In-place variants follow elementwise rules only; random ops are left out of the family."""
    assert "logaddexp" not in REGISTRY.by_name and REGISTRY.lookup("logaddexp") is elementwise
    g, node, (a, b) = _graph(aten.logaddexp.default, [(4, 8), (4, 8)])
    assert _ask(node, {a: Shard(1), b: Shard(1)}).out == Shard(1)
    assert REGISTRY.lookup("masked_fill_") is elementwise
    assert REGISTRY.lookup("transpose_") is None and REGISTRY.lookup("native_dropout") is None


def test_every_value_the_tp_pass_writes_carries_its_placement_on_the_mesh():
    from threefold.compiler.api import compile_workload
    from threefold.ir.program import tf
    from threefold.placement import OnMesh, of, on_mesh_of
    from tests.test_tp_constructs import workload
    prog = compile_workload(workload("nanogpt"), "tp=2")
    nodes = [n for c in prog.chunks for n in c.gm.graph.nodes if n.op == "call_function"]
    written = [n for n in nodes if isinstance(n.meta.get("on_mesh"), OnMesh)]
    assert len(written) > len(nodes) // 2
    assert all(on_mesh_of(n)["tp"] == of(tf(n).get("placement")) for n in written)
    assert {type(on_mesh_of(n)["tp"]).__name__ for n in written} >= {"Shard", "Replicate"}
