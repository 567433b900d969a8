"""After prestart() (`threefold train` calls it) ranks start from a forkserver that imported
torch and torch._dynamo once (runtime/launch.py), yet each sees the launcher's environment
of the moment, as a spawned rank would."""
import os
import sys

import pytest

from threefold.runtime import launch as launcher
from threefold.runtime.launch import launch, prestart, start_context


def _rank_view(name):
    import torch.distributed as dist
    return (os.environ.get(name), "torch._dynamo" in sys.modules, os.getppid(), dist.get_rank())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_see_the_launchers_environment_of_the_moment(monkeypatch):
    monkeypatch.setattr(launcher, "_forkserver_owned", False)     # later tests spawn again
    prestart()
    monkeypatch.setenv("THREEFOLD_TEST_FORKSERVER_ENV", "first")
    first = launch(_rank_view, 2, "THREEFOLD_TEST_FORKSERVER_ENV")
    monkeypatch.setenv("THREEFOLD_TEST_FORKSERVER_ENV", "second")      # after the server started
    second = launch(_rank_view, 2, "THREEFOLD_TEST_FORKSERVER_ENV")
    monkeypatch.delenv("THREEFOLD_TEST_FORKSERVER_ENV")
    third = launch(_rank_view, 2, "THREEFOLD_TEST_FORKSERVER_ENV")
    assert [v for v, *_ in first] == ["first", "first"]
    assert [v for v, *_ in second] == ["second", "second"]
    assert [v for v, *_ in third] == [None, None]
    assert [r for *_, r in first] == [0, 1]
    if start_context().get_start_method() == "forkserver":
        # the preload did the import, and every rank is the one server's child, not ours
        assert all(dynamo for _, dynamo, _, _ in first + second + third)
        parents = {ppid for _, _, ppid, _ in first + second + third}
        assert len(parents) == 1 and os.getpid() not in parents
