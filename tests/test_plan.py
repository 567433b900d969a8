"""Plan: parsing, the text round trip, and what the plan alone can reject."""
import pytest

from threefold import Plan, PlanError


@pytest.mark.parametrize("text", [
    "", "tp=2", "pp=4,m=8", "tp=2,pp=4,dp=2,m=8,v=2,schedule=interleaved",
    "tp=4,sp=true,scatter_gather=false", "pp=2,split=h.2", "pp=3,split=h.1+h.2",
    "fuse=true,recompute=true", "schedule=gpipe,m=3,pp=3",
])
def test_parse_and_str_round_trip(text):
    plan = Plan.parse(text)
    assert Plan.parse(str(plan)) == plan


def test_aliases_and_spaces():
    assert Plan.parse(" tp = 2 , m=4, v=2 ,pp=2, schedule=interleaved".replace(" = ", "=")) == \
        Plan(tp=2, pp=2, microbatches=4, interleave=2, schedule="interleaved")
    assert Plan.parse("pp=3,split=h.1,split=h.2").split_points == ("h.1", "h.2")
    assert Plan(tp=2, pp=2, dp=3).world_size == 12 and Plan(pp=2, interleave=3, schedule="interleaved").num_chunks == 6


@pytest.mark.parametrize("text,needle", [
    ("tp=0", "tp=0"), ("pp=two", "pp='two'"), ("tp2", "malformed"), ("bogus=1", "bogus"),
    ("schedule=zigzag", "zigzag"), ("v=2", "interleaved"), ("pp=1,v=2,schedule=interleaved", "pp>1"),
    ("sp=true", "tp>1"), ("sp=maybe,tp=2", "true or false"),
])
def test_bad_plans_are_one_line_plan_errors(text, needle):
    with pytest.raises(PlanError) as info:
        Plan.parse(text)
    message = str(info.value)
    assert needle in message and "\n" not in message
