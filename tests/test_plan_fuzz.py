"""Random plans on 4 ranks against the single-process run (correct first: any plan, any model).

Each case draws plans from every feature at once (tp, pp, dp, m, every schedule, v, sp,
recompute, zero 0-3, HSDP) with a fixed seed, runs 3 SGD steps of each on 4 gloo ranks and compares
the losses with the single-process run at rtol 1e-5. The slow tier draws a few per model;
the zoo tier draws 30 per model and seed."""
import random

import pytest
import torch

from threefold.runtime.launch import launch
from tests.parity import load_workload, max_rel_diff, parallel_sgd_losses, reference_losses

MODELS = {"gpt": dict(n_layer=4, n_embd=32, n_head=4, seq=16, batch=8),
          "llama": dict(n_layer=4, hidden=32, n_head=4, n_kv_head=2, intermediate=64, seq=16, batch=8)}
WORLD, BATCH, STEPS = 4, 8, 3


def draw_plan(rng: random.Random) -> str:
    """A valid plan for WORLD ranks and a global batch of BATCH."""
    while True:
        tp, pp = rng.choice([1, 2]), rng.choice([1, 2, 4])
        dp = WORLD // (tp * pp)
        if tp * pp * dp != WORLD:
            continue
        schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]) if pp > 1 else "1f1b"
        m = rng.choice([1, 2, 4]) if pp == 1 else rng.choice([2, 4])
        if BATCH % (dp * m) or (schedule == "interleaved" and m % pp):
            continue
        parts = [f"tp={tp}", f"pp={pp}", f"dp={dp}", f"m={m}", f"schedule={schedule}"]
        if schedule in ("interleaved", "zbv"):
            parts.append("v=2")
        if tp > 1 and rng.random() < 0.5:
            parts.append("sp=true")
        recompute = rng.choice(["none", "none", "selective", "full"])
        if recompute != "none":
            parts.append(f"recompute={recompute}")
        if dp > 1 and rng.random() < 0.6:
            parts.append(f"zero={rng.choice([1, 2, 3])}")
            if dp == 4 and rng.random() < 0.5:
                parts.append("dp_shard=2")   # HSDP: two replicas of a 2-way shard group
        return ",".join(parts)


def draw_plans(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return sorted({draw_plan(rng) for _ in range(n)})


def _losses(plans, factory):
    import threefold
    torch.set_num_threads(1)
    out = []
    for plan in plans:
        w = load_workload(factory, **MODELS[factory])
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        losses = parallel_sgd_losses(pm, w, STEPS)
        out.append((plan, losses))
    return out


def _check(factory, plans):
    ref = reference_losses(factory, MODELS[factory], STEPS)
    results = launch(_losses, WORLD, plans, factory, timeout=1700)
    bad = [(plan, max_rel_diff(losses, ref)) for plan, losses in results[0] if max_rel_diff(losses, ref) >= 1e-5]
    assert not bad, (factory, bad, ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("factory", sorted(MODELS))
def test_random_plans_match_single_process(factory):
    _check(factory, draw_plans(seed=7, n=5))


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("factory", sorted(MODELS))
def test_random_plan_matrix_matches_single_process(factory, seed):
    _check(factory, draw_plans(seed, n=30))
