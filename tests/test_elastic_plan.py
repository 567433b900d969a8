"""The plan of a restart on fewer ranks (train/elastic_plan.py): dp shrinks first with the
global batch and the microbatch size kept; the shape changes only where no dp fits."""
import pytest

from threefold import PlanError
from threefold.plan import Plan
from threefold.train.elastic_plan import plan_for_world, smaller_plans


def _rows_per_microbatch(plan, batch):
    return batch // (plan.dp * plan.microbatches)


@pytest.mark.parametrize("text,world,batch", [("pp=2,dp=2,m=4", 3, 16), ("tp=2,pp=2,dp=4,m=2", 12, 32),
                                              ("dp=4,zero=1", 3, 8), ("pp=2,dp=3,m=2", 4, 12)])
def test_dp_shrinks_first_keeping_the_global_batch_and_microbatch_size(text, world, batch):
    old = Plan.parse(text)
    plan, why = next(iter(smaller_plans(old, world, 1, batch)))
    assert (plan.tp, plan.pp, plan.cp, plan.ep) == (old.tp, old.pp, old.cp, old.ep)
    assert plan.dp < old.dp and plan.world_size <= world and "dp" in why
    assert batch % (plan.dp * plan.microbatches) == 0
    assert _rows_per_microbatch(plan, batch) == _rows_per_microbatch(old, batch)
    per = old.world_size // old.dp      # the largest world whose dp divides the batch
    largest = max(w for w in range(per, world + 1, per) if batch % (w // per) == 0)
    assert plan.world_size == largest


def test_the_largest_world_first_and_never_below_min_world():
    old = Plan.parse("pp=2,dp=4,m=2")
    worlds = [p.world_size for p, _ in smaller_plans(old, 7, 4, 24)]
    assert worlds and worlds == sorted(worlds, reverse=True) and min(worlds) >= 4
    assert worlds[0] == 6


def test_the_shape_changes_only_when_no_dp_fits():
    old = Plan.parse("pp=4,m=8")        # dp=1: losing a rank leaves no dp to shrink
    plans = list(smaller_plans(old, 3, 1, 16))
    first, why = plans[0]
    assert first.pp == 2 and "pp 4 -> 2" in why and first.world_size == 2
    assert _rows_per_microbatch(first, 16) == _rows_per_microbatch(old, 16)


def test_torchrun_world_without_a_plan_is_one_line():
    with pytest.raises(PlanError, match="no plan for 3 ranks"):
        plan_for_world(Plan.parse("tp=2,m=1"), 3, 4)
    plan, _ = plan_for_world(Plan.parse("pp=2,dp=2,m=4"), 2, 16)
    assert str(plan) == str(Plan.parse("pp=2,dp=1,m=8"))


def _planner(n_layer=4, n_embd=64, n_head=4, vocab=65, seq=16, batch=4):
    from threefold.planner.cluster import load_cluster
    from threefold.planner.gpt_cost import gpt_model_cost
    from threefold.train.elastic_plan import planner_order
    model, cluster = gpt_model_cost(n_layer, n_embd, n_head, vocab, seq), load_cluster("a100-80gb")
    return lambda plans, world: planner_order(plans, model, batch, cluster)


def test_where_the_shape_must_change_the_planner_picks_among_every_smaller_cut():
    """tp=2,pp=2 on 2 ranks: the fixed order halves pp (tp=2,pp=1); the planner prices every
    smaller cut for the model and the global batch and, for a small model, picks plain dp."""
    from threefold.planner.cluster import load_cluster
    from threefold.planner.estimate import Config, estimate
    from threefold.planner.gpt_cost import gpt_model_cost
    from threefold.train.elastic_plan import fixed_order, reshapes
    old, batch = Plan.parse("tp=2,pp=2,m=2"), 4
    fixed, _ = fixed_order(old, 2, batch)[0]
    picked, why = next(iter(smaller_plans(old, 3, 2, batch, _planner())))
    assert (fixed.tp, fixed.pp) == (2, 1)
    assert (picked.tp, picked.pp, picked.dp) == (1, 1, 2), picked      # they disagree
    assert "planner" in why and "predicted" in why
    assert picked.world_size == 2 and batch % (picked.dp * picked.microbatches) == 0
    assert _rows_per_microbatch(picked, batch) == _rows_per_microbatch(old, batch)
    # the pick is the fastest fitting candidate by the planner's own estimate
    model, cluster = gpt_model_cost(4, 64, 4, 65, 16), load_cluster("a100-80gb")
    times = {str(p): estimate(model, Config(p, batch), cluster).model_s for p in reshapes(old, 2, batch)}
    assert times[str(picked)] == min(times.values()) and len(times) == 3


def test_a_large_model_the_planner_keeps_tp():
    old = Plan.parse("tp=2,pp=2,m=2")
    picked, _ = plan_for_world(old, 2, 8, _planner(8, 4096, 32, 50257, 2048, batch=8))
    assert (picked.tp, picked.pp) == (2, 1)
