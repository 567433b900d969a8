"""Pipeline messages through shared memory (runtime/local_p2p.py) move the same bytes as gloo.

With the channels on, the losses and gradients are bit-identical to THREEFOLD_LOCAL_P2P=0
(gloo) and within fp32 tolerance of one process; a rank that cannot see the segment (as on
another host) makes every rank use gloo; a message larger than the ring goes through gloo;
a peer killed mid-step makes the others fail naming it; nothing is left in the channels'
directory. The channel itself: ordering over many messages, ring wrap-around, a bounded wait.
"""
import pytest
import torch

from tests.p2p_jobs import channel_unit, die_mid_step, on_and_off, reference
from tests.parity import max_rel_diff
from threefold.runtime.launch import LaunchError, launch


def _check(results: list[list[dict]], ref: list[float], local: bool) -> None:
    for r in results:
        for on, off in zip(r[0::2], r[1::2]):
            assert on["plan"] == off["plan"] and on["on"] and not off["on"]
            assert max_rel_diff(on["losses"], ref) < 1e-5, (on["plan"], on["losses"], ref)
            assert on["losses"] == off["losses"], (on["plan"], on["losses"], off["losses"])
            assert on["grads"].keys() == off["grads"].keys() and on["grads"]
            for k in on["grads"]:
                assert torch.equal(on["grads"][k], off["grads"][k]), (on["plan"], k)
            assert off["local"] == 0
            assert (on["local"] > 0) == local, (on["plan"], on["local"])


def test_a_slot_for_every_message_of_a_step_within_the_budget():
    from threefold.runtime.local_p2p import ring_shapes
    step = {(0, 1): [1024] * 8, (1, 0): [64, 64, 4096]}
    assert ring_shapes(step, 2**20) == {(0, 1): (8, 1024), (1, 0): (3, 4096)}
    # the budget holds 3 slots of 64 B, not of 4096: the 4096 B message goes through gloo
    assert ring_shapes(step, 3 * 64) == {(1, 0): (3, 64)}
    assert ring_shapes(step, 100) == {}       # no ring of fewer slots than messages: gloo


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_channel_order_wraparound_and_timeout(tmp_path):
    # a budget of 300 bytes: 4 slots of 64 B, so 52 messages wrap the ring 13 times
    r0, r1 = launch(channel_unit, 2, str(tmp_path), str(300 / 2**20), timeout=180)
    assert (r0["slots"], r0["slot_bytes"]) == (4, 64)
    assert (r0["local"], r0["gloo"]) == (52, 8)      # every 7th message is over the slot: gloo
    assert r1["ok"]
    message, seconds = r1["timeout"]
    assert message.startswith("rank 1: receiving a message never sent from rank 0 failed"), message
    assert 1.9 < seconds < 10, seconds
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_schedules_on_off_and_one_process(tmp_path):
    plans = ["pp=2,m=4", "pp=2,m=4,v=2,schedule=interleaved", "pp=2,m=4,schedule=zbv"]
    _check(launch(on_and_off, 2, plans, 3, str(tmp_path), timeout=280), reference(), local=True)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pp4_interleaved_and_dp_on_off_and_one_process(tmp_path):
    plans = ["pp=4,m=8,v=2,schedule=interleaved", "pp=2,dp=2,m=4"]
    _check(launch(on_and_off, 4, plans, 3, str(tmp_path), timeout=380), reference(), local=True)
    assert not list(tmp_path.iterdir())


@pytest.mark.zoo
@pytest.mark.timeout(900)
@pytest.mark.parametrize("plans", [["pp=4,m=8", "pp=4,m=8,schedule=zbv"], ["pp=2,tp=2,m=4"],
                                   ["pp=2,m=4,schedule=zb-h1", "pp=2,m=4,schedule=gpipe"]])
def test_more_plans_on_off_and_one_process(tmp_path, plans):
    n = 4 if any("pp=4" in p or "tp=2" in p for p in plans) else 2
    _check(launch(on_and_off, n, plans, 3, str(tmp_path), timeout=880), reference(), local=True)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_other_host_and_oversized_messages_fall_back_to_gloo(tmp_path):
    """Rank 1 looks for the segments in its own folder (as a rank on another host): every
    rank uses gloo. Then a ring smaller than one message: gloo again, the same numbers."""
    shared, own = tmp_path / "shared", tmp_path / "own"
    shared.mkdir()
    own.mkdir()
    ref = reference()
    _check(launch(on_and_off, 2, ["pp=2,m=4"], 3, str(shared), str(own), timeout=280), ref, local=False)
    assert not list(shared.iterdir()) and not list(own.iterdir())
    results = launch(on_and_off, 2, ["pp=2,m=4"], 3, str(shared), None, "0.0001", timeout=280)
    _check(results, ref, local=False)
    assert not list(shared.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_peer_makes_the_others_fail_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("THREEFOLD_TIMEOUT", "50")
    victim = 2
    with pytest.raises(LaunchError) as info:
        launch(die_mid_step, 4, victim, str(tmp_path), timeout=200, grace=70)
    errors = info.value.errors
    assert set(errors) == {0, 1, 2, 3}, errors
    assert "died" in errors[victim]
    for rank in (0, 1, 3):
        msg = errors[rank]
        assert f"rank {rank}: " in msg and "failed" in msg and f"rank {victim}" in msg, msg
        assert float(msg.split("[after ")[1].split(" s]")[0]) < 50, msg
    # a neighbour of the dead stage sees its channel close at once and names it
    assert any(f"from rank {victim} failed" in errors[r] or f"to rank {victim} failed" in errors[r]
               for r in (1, 3)), errors
    assert not list(tmp_path.iterdir())
