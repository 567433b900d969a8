"""bench/pipeline_share_bound.py: with a core per rank it reproduces runtime/simulate.py; with
fewer cores no schedule beats the work / cores bound, and 1F1B keeps most of its bubble filled."""
import pytest

from tests import bench_scripts
from threefold.runtime.schedule import make_schedule
from threefold.runtime.simulate import simulate

_bound = bench_scripts.load("pipeline_share_bound")
SCHEDULES, shared_makespan, unit_costs = _bound.SCHEDULES, _bound.shared_makespan, _bound.unit_costs


@pytest.mark.parametrize("kind,v", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_core_per_rank_matches_the_simulator(kind, v, pp):
    sched = make_schedule(kind, pp, 8, v)
    span, _ = shared_makespan(sched, unit_costs(kind, v), cores=pp)
    # the simulator's unit costs are per chunk (a v=2 chunk costs what a v=1 one does)
    assert span == pytest.approx(simulate(sched).makespan / v)


@pytest.mark.parametrize("kind,v", SCHEDULES)
def test_shared_cores_never_beat_work_over_cores(kind, v):
    sched = make_schedule(kind, 4, 8, v)
    span, util = shared_makespan(sched, unit_costs(kind, v), cores=2)
    work = 4 * 8 * 3          # pp ranks x m microbatches x (F + B [+ W]) units
    assert span >= work / 2 - 1e-9 and 0 < util <= 1 + 1e-9
    one_core_each, _ = shared_makespan(sched, unit_costs(kind, v), cores=4)
    assert span > one_core_each   # half the cores: slower, but by less than 2x
    assert span < 2 * one_core_each
