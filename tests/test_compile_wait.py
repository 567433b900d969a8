"""The other ranks wait for rank 0's compile under THREEFOLD_COMPILE_TIMEOUT, not under the
collective timeout: on a loaded machine a compile can take longer than THREEFOLD_TIMEOUT
(a 4-layer LLaMA took over 60 s at load 30), and that is not a hung rank."""
import os
import time

import pytest
import torch

from threefold.runtime.launch import launch


def _slow_compile_job(delay: float) -> float:
    import threefold
    import threefold.api as api
    from tests.parity import load_workload
    torch.set_num_threads(1)
    compile_payload = api._compile_payload

    def slow(*args, **kwargs):
        time.sleep(delay)
        return compile_payload(*args, **kwargs)

    api._compile_payload = slow
    w = load_workload("gpt", n_layer=2, n_embd=16, n_head=2, seq=8, batch=4)
    pm = threefold.parallelize(w["model"], "pp=2,m=2", w["inputs"], w["loss_fn"], target=w["target"])
    return pm.step(*w["inputs"], target=w["target"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compile_longer_than_the_collective_timeout_is_waited_for(monkeypatch):
    monkeypatch.setenv("THREEFOLD_TIMEOUT", "4")
    losses = launch(_slow_compile_job, 2, 10.0, timeout=200)
    assert losses[0] == losses[1] and losses[0] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compile_past_the_compile_timeout_fails_naming_it(monkeypatch):
    monkeypatch.setenv("THREEFOLD_COMPILE_TIMEOUT", "3")
    with pytest.raises(Exception, match="did not finish compiling within 3 s"):
        launch(_slow_compile_job, 2, 15.0, timeout=200)
