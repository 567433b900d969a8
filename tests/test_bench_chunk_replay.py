"""bench/chunk_replay.py replays every stage's F/B/W actions: each action is timed and every
parameter gets its gradient, under a fused and a split schedule alike."""
import pytest
import torch

from tests.bench_scripts import bench_on_path


@pytest.mark.parametrize("kind", ["interleaved", "zbv"])
def test_replay_times_every_action_and_fills_every_grad(kind):
    with bench_on_path():   # the whole test: the scripts import siblings as they run
        import chunk_replay
        from pipeline_overhead import Config
        cfg = Config(pp=4, m=4, n_layer=8, n_embd=32, vocab_size=64, seq=16, batch=8)
        torch.manual_seed(0)
        built = chunk_replay.build(cfg, kind)
        times = {}
        chunk_replay.step(built, times)
        sched, mods = built[0], built[1]
        kinds = {"F", "B", "W"} if sched.splits_backward else {"F", "B"}
        assert {k for k in times if isinstance(k, str) and len(k) == 1} == kinds
        for c in mods:
            for x in kinds:
                assert times[(x, c)] > 0
        for c, mod in mods.items():
            for name, p in mod.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), (c, name)
                assert p.grad.abs().sum() > 0, (c, name)
