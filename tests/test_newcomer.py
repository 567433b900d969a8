"""What a new user meets first: readable sizes, --version, the local rank guard in
threefold.launch, generate's threads, and Triton as an extra (fuse=true without it is a
one-line PlanError)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import threefold
from threefold.cli.inspect_cmd import human, human_bytes


@pytest.mark.parametrize("x,text", [(100, "100 B"), (1047000, "0.998 MiB"), (1048400, "1 MiB"),
                                    (1023.9 * 1024, "1 MiB"), (5 * 2**20, "5 MiB"), (1536, "1.5 KiB"),
                                    (3 * 2**50, "3072 TiB")])
def test_bytes_are_printed_in_human_units_never_as_exponents(x, text):
    assert human_bytes(x) == text


def test_counts_never_print_exponents():
    assert human(999_999) == "1M" and human(1_234_567) == "1.23M" and human(12) == "12"
    for x in (999.6, 999_600, 1023 * 1024, 10**21):
        assert "e+" not in human(x) and "e+" not in human_bytes(x)


def test_version_flag_names_threefold_and_torch(capsys):
    from threefold.cli.main import main
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"threefold {threefold.__version__} (torch ")


def test_launch_applies_the_local_rank_guard_before_spawning(monkeypatch):
    monkeypatch.setenv("THREEFOLD_MAX_LOCAL_RANKS", "4")
    with pytest.raises(threefold.PlanError, match="more than this machine runs locally"):
        threefold.launch(print, 16)


def test_generate_uses_one_thread_for_a_small_model_unless_told(monkeypatch):
    from threefold.cli.generate_cmd import SMALL_MODEL_PARAMS, generate_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert generate_threads(None, 1_000_000) == 1
    assert generate_threads(None, SMALL_MODEL_PARAMS * 2) >= 1
    assert generate_threads(3, 10) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert generate_threads(None, 10) == 2
    with pytest.raises(threefold.PlanError, match="--threads 0"):
        generate_threads(0, 10)


def test_fuse_without_triton_installed_is_a_plan_error(monkeypatch):
    from threefold.codegen.artifact import build_sources
    from threefold.compiler.api import compile_workload
    from tests.parity import load_workload
    prog = compile_workload(load_workload("gpt", n_layer=1, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=2),
                            "fuse=true")
    assert prog.kernels
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(threefold.PlanError, match=r"threefold\[gpu\]"):
        build_sources(prog)


def test_compile_phases_print_a_line_each_when_asked_and_nothing_under_json(monkeypatch, capsys):
    from threefold.cli.phases import Phases
    monkeypatch.setenv("THREEFOLD_PROGRESS", "1")
    with Phases("check") as progress:
        for stage in ("trace", "graph_cleanup", "tensor_parallel", "cost (trial)"):
            progress(stage)
    lines = capsys.readouterr().err.splitlines()
    assert [l.split(": ")[2].split(" [")[0] for l in lines] == [
        "trace (torch.export)...", "compiler passes...", "cost (trial)...", "done"]
    with Phases("check", enabled=False) as progress:      # --json
        progress("trace")
    monkeypatch.delenv("THREEFOLD_PROGRESS")
    with Phases("check") as progress:                      # not a terminal, not asked: quiet
        progress("trace")
    assert capsys.readouterr().err == ""
