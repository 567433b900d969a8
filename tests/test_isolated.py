"""run_in_child: a forked child's result comes back; its errors keep their type; a child
that dies or hangs is an error naming the work, never a hang."""
import os
import sys
import time

import pytest

from threefold.errors import PlanError
from threefold.isolated import ChildFailed, fork_available, run_in_child

pytestmark = pytest.mark.skipif(not fork_available(), reason="fork-based isolation is Linux only")


def _work(x):
    import torch
    return {"pid": os.getpid(), "sum": torch.arange(x).sum().item()}


def test_result_comes_back_from_another_process():
    got = run_in_child(_work, 5, what="a sum")
    assert got["sum"] == 10 and got["pid"] != os.getpid()


def _bad_plan():
    raise PlanError("plan tp=3 does not divide 4 heads: use tp=2 or tp=4")


def test_plan_errors_keep_their_type_and_message():
    with pytest.raises(PlanError, match="tp=3 does not divide"):
        run_in_child(_bad_plan, what="compiling")


def _die():
    os._exit(3)


def test_a_child_that_dies_is_named():
    with pytest.raises(ChildFailed, match="doing compiling on rank 0 died"):
        run_in_child(_die, what="compiling on rank 0")


def _hang():
    time.sleep(60)


@pytest.mark.timeout(30)
def test_a_hung_child_is_killed_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(ChildFailed, match="did not finish within 1 s"):
        run_in_child(_hang, what="compiling", timeout=1.0)
    assert time.monotonic() - start < 10


def _imports_a_module():
    import mailbox  # noqa: F401  (a standard module nothing in threefold imports)
    return "mailbox" in sys.modules


def test_what_the_child_imports_stays_in_the_child():
    sys.modules.pop("mailbox", None)
    assert run_in_child(_imports_a_module, what="importing") is True
    assert "mailbox" not in sys.modules
