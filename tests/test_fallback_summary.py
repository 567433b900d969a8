"""Fallbacks that cost memory or speed are named in one line when a job starts, with their
share and the inspect command; an empty pipeline stage is a PlanError; pipeline cuts keep
layers whole when that costs at most a few percent of balance."""
from __future__ import annotations

import re

import pytest
import torch

import threefold
from threefold.compiler.api import compile_workload
from threefold.fallbacks import fallback_line
from tests.parity import load_workload


def test_tp_that_does_not_divide_the_heads_names_the_weights_kept_whole_and_their_share():
    w = load_workload("llama", hidden=48, n_head=4, n_kv_head=2, intermediate=96, batch=6)
    line = fallback_line(compile_workload(w, "tp=3"), "threefold inspect SPEC --plan tp=3")
    share = re.search(r"(\d+)% of parameters kept whole on every tp rank", line)
    assert share and 0 < int(share.group(1)) < 100, line
    assert "k_proj" in line and "v_proj" in line and "padded" in line
    assert line.endswith("(details: threefold inspect SPEC --plan tp=3)") and "\n" not in line
    assert fallback_line(compile_workload(w, "tp=2"), "x") == ""          # 2 divides everything: quiet


class _OneWeightThenPointwise(torch.nn.Module):
    """One linear, then a long parameter-free tail: a second stage would hold no weight."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        for _ in range(40):
            y = torch.sin(y) * 1.01 + 0.1
        return y


def test_a_pipeline_stage_without_parameters_is_a_plan_error():
    with pytest.raises(threefold.PlanError, match=r"pp=2 leaves pipeline stage 1 without any parameter.*pp <= 1"):
        compile_workload({"model": _OneWeightThenPointwise(), "inputs": (torch.randn(4, 8),)}, "pp=2,m=2")


def _layers_of(chunk) -> set[str]:
    return {".".join(p.split(".")[:2]) for p in chunk.params if p.startswith("h.")}


def test_pipeline_cuts_fall_between_layers_when_balance_allows_and_say_so_when_not():
    even = compile_workload(load_workload("gpt", n_layer=4, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=4),
                            "pp=2,m=2")
    first, second = (_layers_of(c) for c in even.chunks)
    assert not first & second, (first, second)                       # no layer on both stages
    assert not any(n.startswith("pipeline cut inside a layer") for n in even.notes)
    odd = compile_workload(load_workload("gpt", n_layer=3, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=4),
                           "pp=2,m=2")
    line = fallback_line(odd, "inspect")
    assert re.search(r"pipeline cut inside a layer \(h\.1\): cutting at layers would make the slowest stage "
                     r"\d+% slower", line), line
