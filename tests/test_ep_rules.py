"""ep's region rules (passes/ep_rules.py): pure per-op decisions on the shared registry
(threefold/ops/rules.Registry) saying which ops may sit between expert matmuls."""
from __future__ import annotations

import torch

from threefold.ops.rules import Decision, NoRule
from threefold.ops.families import PLACE_BY_POSITION as BY_POSITION
from threefold.passes.ep_rules import EP, RegionCall, decide, row_wise
from threefold.passes.row_state import Rows


def _graph():
    class F(torch.nn.Module):
        def forward(self, rows, table):
            a = torch.relu(rows)                          # row-wise
            pos = a.argmax(-1)                            # per row, a position computed from the rows
            picked = torch.embedding(table, pos)          # placed by that position
            return a, picked, a.sum(0)                    # sum over the rows mixes them
    ep = torch.export.export(F(), (torch.randn(6, 4), torch.randn(4, 3)))
    return ep.graph_module.graph


def test_rules_keep_row_wise_ops_and_refuse_mixing_or_positions_from_rows():
    g = _graph()
    nodes = {n.name: n for n in g.nodes}
    states = {nodes["rows"]: Rows(0, 1), nodes["table"]: None}
    verdicts = {}
    for n in g.nodes:
        if n.op == "call_function":
            states[n], verdicts[n.name] = decide(n, states, 6)
    assert verdicts["relu"] is None and states[nodes["relu"]] == Rows(0, 1)
    assert verdicts["embedding"] == "it places values by positions computed from the rows"
    assert verdicts["sum_1"] and "batch" in verdicts["sum_1"], verdicts


def test_registry_lists_position_ops_and_rules_are_pure():
    assert "embedding" in EP.names() and "index_select" in EP.names() and BY_POSITION <= EP.names()
    g = _graph()
    relu = next(n for n in g.nodes if n.name == "relu")
    before = [(n.name, n.target, n.args) for n in g.nodes]
    call = RegionCall(relu, "relu", {}, 6, Rows(0, 1), None)
    assert isinstance(row_wise(call), Decision)
    assert isinstance(EP.decide("embedding", relu, RegionCall(relu, "embedding", {}, 6, None, "mixes")), NoRule)
    assert [(n.name, n.target, n.args) for n in g.nodes] == before     # nothing in the graph changed


def test_ops_table_has_an_ep_column(capsys):
    import json
    from threefold.cli.main import main
    assert main(["ops", "--axis", "ep", "--json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["embedding"]["ep"].startswith("rule by_position") and rows["gelu"]["ep"].startswith("rule row_wise")
