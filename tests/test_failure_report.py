"""A rank's failure is reported with its traceback (file:line), once; the peers that failed
because of it get one line each, without gloo's boilerplate; LaunchError.errors keeps all."""
from __future__ import annotations

import pytest

from threefold.runtime.failure_report import failure_report, first_failure

GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:16070. This is typically caused by a remote worker crashing. Check the "
        "logs of the remote worker before reporting an error. GLHF! \U0001F3D6\nTraceback (most recent call last):\n"
        '  File "torch/distributed/c10d.py", line 1, in all_reduce\nRuntimeError: ...')
OWN = ("KeyError: 'missing'\nTraceback (most recent call last):\n  File \"/job.py\", line 10, in job\n"
       "    bad({})\n  File \"/job.py\", line 5, in bad\n    return x[\"missing\"]\nKeyError: 'missing'\n")


def test_the_first_failure_is_shown_with_its_traceback_and_the_peers_in_one_line_each():
    errors = {0: GLOO, 1: OWN, 2: GLOO}      # rank 0's consequence happened to arrive first
    text = failure_report(errors, {}, 3)
    lines = text.splitlines()
    assert lines[0] == "3 of 3 ranks failed; rank 1 failed first:"
    assert lines[1] == "  rank 1: KeyError: 'missing'"
    assert text.count('File "/job.py", line 10, in job') == 1 and text.count("KeyError") == 1
    peers = [line for line in lines if line.startswith("  rank 0:") or line.startswith("  rank 2:")]
    assert len(peers) == 2 and all("Connection closed by peer" in p and "(after rank 1 failed)" in p for p in peers)
    assert "GLHF" not in text and "pair.cc" not in text and "c10d.py" not in text


def test_a_rank_the_launcher_saw_die_comes_first_and_equal_errors_are_folded():
    assert first_failure({3: "RankFailure: rank 3: recv from rank 1 failed", 1: "rank 1 died (killed by SIGKILL)"},
                         {1: "rank 1 died (killed by SIGKILL)"}) == 1
    text = failure_report({0: OWN, 1: OWN}, {}, 2)
    assert "  rank 1: the same error" in text and text.count("Traceback") == 1


def _fails_on_rank_1():
    import torch
    import torch.distributed as dist
    t = torch.ones(2)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke here")     # the line the report must point at
    dist.all_reduce(t)
    return 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_launcher_reports_the_failing_ranks_traceback_once():
    from threefold.runtime.launch import LaunchError, launch
    with pytest.raises(LaunchError) as info:
        launch(_fails_on_rank_1, 2, timeout=100)
    text = str(info.value)
    assert text.splitlines()[1] == "  rank 1: ValueError: rank 1 broke here"
    assert text.count("test_failure_report.py\", line") == 1 and "in _fails_on_rank_1" in text
    assert text.count("Traceback (most recent call last)") == 1 and "GLHF" not in text
    assert len(text.splitlines()) < 12
    assert set(info.value.errors) == {0, 1} and "Traceback" in info.value.errors[1]
