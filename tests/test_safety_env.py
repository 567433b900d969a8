"""Every THREEFOLD_* variable is checked before any rank starts (issue 45 item 5): one line,
exit 2, in the parent, in well under the ranks' start-up time."""
from __future__ import annotations

import os
import time

import pytest

from threefold.cli.main import main

TRAIN = ["train", "--steps", "1", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq", "8", "--batch", "2",
         "--eval-every", "0", "--sample-tokens", "0", "--plan", "tp=1"]


def _bad_env(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    return [("THREEFOLD_TRACE", str(afile / "t.json"), "is a file"),
            ("THREEFOLD_DEBUG_DIR", str(afile / "dbg"), "is a file"),
            ("THREEFOLD_DEBUG_DIR", str(afile), "not a directory"),
            ("THREEFOLD_CACHE_DIR", str(afile / "c"), "is a file"),
            ("THREEFOLD_LOCAL_P2P_MB", "inf", "at most"), ("THREEFOLD_LOCAL_P2P_MB", "nan", "above 0"),
            ("THREEFOLD_TIMEOUT", "0.001", "from 1"), ("THREEFOLD_TIMEOUT", "inf", "from 1"),
            ("THREEFOLD_COMPILE_TIMEOUT", "-1", "seconds"), ("THREEFOLD_PIN", "all", "'cores'"),
            ("THREEFOLD_KERNELS", "cuda", "'eager'"), ("THREEFOLD_BACKEND", "mpi", "'gloo'"),
            ("THREEFOLD_LOCAL_P2P", "off", "'0'"), ("THREEFOLD_LOCAL_REDUCE", "2", "'1'"),
            ("THREEFOLD_SDPA_REWRITE", "yes", "'0'"), ("THREEFOLD_MALLOC", "fast", "'default'"),
            ("THREEFOLD_MAX_LOCAL_RANKS", "\uff18", "whole number"), ("THREEFOLD_MAX_LOCAL_RANKS", "0", "from 1"),
            ("THREEFOLD_TRACE_STEPS", "x", "THREEFOLD_TRACE_STEPS"), ("THREEFOLD_JOB_SECRET", " ", "empty"),
            ("THREEFOLD_TIMOUT", "60", "did you mean THREEFOLD_TIMEOUT")]


def test_every_bad_threefold_variable_is_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    cases = _bad_env(tmp_path)
    for name, value, words in cases:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            capsys.readouterr()
            t0 = time.perf_counter()
            code = main([*TRAIN, "--out", str(tmp_path / "o")])
            err = capsys.readouterr().err.strip()
            assert code == 2 and "\n" not in err and words in err and name.split("_")[1] in err, (name, value, err)
            assert time.perf_counter() - t0 < 5, (name, "checked after start-up work")
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("name,value", [("THREEFOLD_TIMEOUT", "60"), ("THREEFOLD_PIN", "cores"),
                                        ("THREEFOLD_KERNELS", ""), ("THREEFOLD_LOCAL_P2P_MB", "64"),
                                        ("THREEFOLD_TABLE_OUT", "x")])
def test_good_values_and_unrelated_names_pass(name, value):
    from threefold.env_check import check_env
    check_env({name: value})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_launcher_bounds_every_ranks_start_up(monkeypatch):
    """A rank that never joins the job (its arguments import a module that blocks) is
    stopped after the start-up limit, with one line naming it, instead of waiting forever."""
    from threefold.runtime.launch import LaunchError, launch
    from tests.hang_at_import import value
    monkeypatch.setenv("H45_HANG_AT_IMPORT", "1")
    t0 = time.perf_counter()
    with pytest.raises(LaunchError) as e:
        launch(value, 2, 1, start_timeout=8)
    assert time.perf_counter() - t0 < 60
    assert "did not join the job within 8 s" in str(e.value), str(e.value)
    monkeypatch.setenv("H45_HANG_AT_IMPORT", "0")
    assert launch(value, 2, 3, start_timeout=120) == [3, 3]
