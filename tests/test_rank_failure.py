"""A rank that dies mid-step makes every other rank fail loudly, naming it, within 60 s."""

import pytest

from threefold.runtime.launch import LaunchError, launch

VICTIM = 2


def _train_then_die(victim: int):
    import torch

    import threefold
    from tests.dying import kill_in_forward, step_timing_failure
    from tests.parity import load_workload
    w = load_workload("gpt", n_layer=4, n_embd=16, n_head=2, seq=8, batch=8)
    pm = threefold.parallelize(w["model"], "pp=4,m=4", w["inputs"], w["loss_fn"], target=w["target"])
    pm.step(*w["inputs"], target=w["target"])          # one healthy step
    if torch.distributed.get_rank() == victim:
        kill_in_forward(pm)   # during the forward of microbatch 2 of the next step
    return step_timing_failure(pm, w)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dead_rank_makes_the_others_fail_naming_it(monkeypatch):
    monkeypatch.setenv("THREEFOLD_TIMEOUT", "50")
    with pytest.raises(LaunchError) as info:
        launch(_train_then_die, 4, VICTIM, timeout=200, grace=70)
    errors = info.value.errors
    assert set(errors) == {0, 1, 2, 3}, errors
    assert "died" in errors[VICTIM]
    for rank in (0, 1, 3):
        msg = errors[rank]
        assert f"rank {rank}: " in msg and "failed" in msg, msg
        assert f"rank {VICTIM}" in msg, msg   # directly, or via the failure a neighbour posted
        seconds = float(msg.split("[after ")[1].split(" s]")[0])
        assert seconds < 60, msg
    # direct neighbours of the dead stage name it as the peer they lost
    assert f"rank {VICTIM} failed" in errors[1] or f"rank {VICTIM} failed" in errors[3]


def _compiled_tp_then_die(victim: int):
    import torch

    import threefold
    from tests.dying import kill_in_forward, step_timing_failure
    from tests.parity import load_workload
    torch.set_num_threads(1)
    w = load_workload("gpt", n_layer=2, n_embd=32, n_head=2, seq=8, batch=8)
    pm = threefold.parallelize(w["model"], "tp=2,m=4,compile=inductor", w["inputs"], w["loss_fn"],
                               target=w["target"])
    for _ in range(2):     # compiled (the second step: any recompile done)
        pm.step(*w["inputs"], target=w["target"])
    if torch.distributed.get_rank() == victim:
        kill_in_forward(pm)
    return step_timing_failure(pm, w)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dead_rank_inside_a_compiled_tp_graph_makes_the_other_fail_loudly(monkeypatch):
    """compile=inductor traces tp's collectives into the chunk's graph (runtime/tp_ops.py):
    a peer dying mid-graph still fails the survivor at once, as comm's failures read."""
    monkeypatch.setenv("THREEFOLD_TIMEOUT", "50")
    with pytest.raises(LaunchError) as info:
        launch(_compiled_tp_then_die, 2, 1, timeout=500, grace=70)
    errors = info.value.errors
    assert "died" in errors[1], errors
    msg = errors[0]
    assert "rank 0: a collective in chunk 0 forward (a compiled graph) with ranks [0, 1] failed" in msg, msg
    assert "died, failed or is stuck" in msg, msg
    assert float(msg.split("[after ")[1].split(" s]")[0]) < 60, msg
