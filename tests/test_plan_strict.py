"""Plan values parsed strictly (issue 45 item 4, issue 41 item 6): ASCII digits only, the
documented boolean spellings only, a typo'd key gets a suggestion (in text and in Plan(...)),
and keys that would do nothing are named before any rank starts."""
from __future__ import annotations

import pytest

from threefold import Plan, PlanError
from threefold.plan_defaults import resolve_plan


@pytest.mark.parametrize("text", ["tp=\uff12", "tp=\u0662", "tp=1_0", "tp=+2", "tp= 2x", "dp_shard=\uff12"])
def test_numbers_are_ascii_digits_only(text):
    with pytest.raises(PlanError, match="ASCII digits|malformed"):
        Plan.parse(text)


@pytest.mark.parametrize("word,value", [("true", True), ("1", True), ("YES", True), ("on", True),
                                        ("false", False), ("0", False), ("No", False), ("off", False)])
def test_documented_boolean_spellings(word, value):
    assert Plan.parse(f"strict={word}").strict is value


@pytest.mark.parametrize("word", ["\uff59es", "y", "t", "2", "enabled", "tru\u0435"])
def test_other_boolean_spellings_are_refused(word):
    with pytest.raises(PlanError, match="use true or false"):
        Plan.parse(f"strict={word}")


def test_a_typo_gets_did_you_mean_in_text_and_in_the_constructor():
    with pytest.raises(PlanError, match="did you mean 'schedule'"):
        Plan.parse("shedule=gpipe")
    with pytest.raises(PlanError, match="did you mean 'schedule'"):
        Plan(shedule="gpipe")
    with pytest.raises(PlanError, match="did you mean 'microbatches'"):
        Plan(microbatch=2)
    with pytest.raises(PlanError, match="positional"):
        Plan(*range(40))


def test_empty_plan_and_spaces_around_items_are_the_documented_forms():
    assert Plan.parse("") == Plan() == Plan.parse("   ")
    assert Plan.parse(" tp=2 , pp=2 ") == Plan(tp=2, pp=2)
    with pytest.raises(PlanError, match="malformed"):
        Plan.parse("tp = 2 x")


def test_dp_shard_without_zero_is_an_error_and_zero_without_dp_a_note():
    with pytest.raises(PlanError, match="needs zero>=1"):
        Plan.parse("dp=2,dp_shard=2")
    notes = resolve_plan("zero=3").notes
    assert len(notes) == 1 and "nothing is sharded" in notes[0] and "\n" not in notes[0]
    assert resolve_plan("dp=2,zero=3").notes == ()
