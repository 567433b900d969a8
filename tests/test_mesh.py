"""The named mesh: Megatron's rank formula by default, groups along any axis or alias."""
import itertools

import pytest

from threefold import Plan, PlanError
from threefold.runtime.mesh import AXES, Mesh


@pytest.mark.parametrize("tp,dp,pp", list(itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3))))
def test_default_layout_is_megatrons_rank_formula(tp, dp, pp):
    mesh = Mesh(tp=tp, dp=dp, pp=pp)
    assert mesh.world_size == tp * dp * pp
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        r = t + tp * (d + dp * p)
        assert mesh.rank(tp=t, dp=d, pp=p) == r
        c = mesh.coord(r)
        assert (c.tp, c.dp, c.pp) == (t, d, p)
        assert mesh.tp_group(r) == [mesh.rank(tp=k, dp=d, pp=p) for k in range(tp)]
        assert mesh.dp_group(r) == [mesh.rank(tp=t, dp=k, pp=p) for k in range(dp)]
        assert mesh.pp_group(r) == [mesh.rank(tp=t, dp=d, pp=k) for k in range(pp)]


def test_groups_partition_the_world_along_any_axis_product():
    mesh = Mesh(tp=2, dp=4, dp_shard=2, pp=2)
    assert [n for n, _ in mesh.axes] == [a.name for a in AXES if not a.optional]   # ep: only when > 1
    for names in ("tp", "dp", "pp", "dp_shard", "dp_replicate", ("dp", "tp"), ("pp", "tp")):
        groups = mesh.groups(names)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(mesh.world_size))
        assert all(len(g) == mesh.size(names) for g in groups)
    # HSDP: replicas are outer (across nodes), shards inner
    assert mesh.group(0, "dp_shard") == [0, 2]
    assert mesh.group(0, "dp_replicate") == [0, 4]
    assert mesh.group(0, "dp") == [0, 2, 4, 6]
    c = mesh.coord(6)
    assert (c.dp_replicate, c.dp_shard, c.dp) == (1, 1, 3)
    assert mesh.moved(6, pp=1) == 6 + 8


def test_axes_absent_have_size_one_and_typos_fail():
    mesh = Mesh(tp=2)
    assert mesh.size("cp") == 1 and mesh.cp == 1
    with pytest.raises(AttributeError):
        mesh.tpp


def test_plan_mesh_hsdp_and_errors():
    plan = Plan.parse("dp=4,zero=3,dp_shard=2")
    assert plan.mesh.size("dp_replicate") == 2 and plan.mesh.size("dp_shard") == 2
    assert str(Plan.parse(str(plan))) == str(plan)
    assert Plan.parse("dp=4,zero=3,dp_shard=4").dp_shard is None   # the default, one form
    with pytest.raises(PlanError, match="must divide dp"):
        Plan.parse("dp=4,zero=3,dp_shard=3")
    with pytest.raises(PlanError, match="needs zero>=1"):
        Plan.parse("dp=4,dp_shard=2")
