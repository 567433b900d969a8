"""What the local launcher says when ranks fail: the rank that failed first, with its
traceback (file:line of every frame), once; every other rank in one line.

When one rank fails, its peers fail too, as consequences: a collective or transfer loses
its peer (gloo's "Connection closed by peer ..."), comm.py's RankFailure names the rank, or
the launcher stops them. Printing all of those in full buries the one that matters, so
the report is

    3 of 3 ranks failed; rank 1 failed first:
      rank 1: KeyError: 'missing'
        Traceback (most recent call last):
          File "job.py", line 10, in job
        ...
      rank 0: RuntimeError: Connection closed by peer [127.0.0.1]:16070 (after rank 1 failed)
      rank 2: ... (after rank 1 failed)

The first failure is a rank the launcher saw die or stop, else the first rank to report an
error that is not such a consequence (reports arrive in time order), else the first
report. `LaunchError.errors` keeps every rank's full text.
"""
from __future__ import annotations

import re
import traceback

FRAMES = 25         # innermost frames of a rank's traceback kept
LINE = 200          # longest one-line summary of another rank

# The first line of a rank that failed because another one did.
_CONSEQUENCE = re.compile(
    r"RankFailure|Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused"
    r"|died, failed or is stuck|was stopped after another rank failed|did not finish within"
    r"|Timed out|timed out|\. Reported: ")


def rank_traceback(exc: BaseException) -> str:
    """The traceback a rank reports: its innermost frames, without the launcher's own."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(exc), exc, tb, limit=-FRAMES))


def is_consequence(text: str) -> bool:
    return bool(_CONSEQUENCE.search(str(text).splitlines()[0] if str(text) else ""))


def first_failure(errors: dict[int, str], causes: dict[int, str]) -> int:
    """The rank whose failure came first (`errors` in arrival order; `causes`: ranks the
    launcher saw die or stop)."""
    if causes:
        return min(r for r in causes if r in errors) if any(r in errors for r in causes) else min(errors)
    own = [r for r, text in errors.items() if not is_consequence(text)]
    return own[0] if own else next(iter(errors))


def failure_report(errors: dict[int, str], causes: dict[int, str], nprocs: int) -> str:
    """The LaunchError message (see the module docstring)."""
    root = first_failure(errors, causes)
    head, tb = _split(errors[root], root)
    if is_consequence(head):        # every rank lost a peer: no own failure to show in full
        head = _short(head)
    lines = [f"{len(errors)} of {nprocs} ranks failed; rank {root} failed first:", f"  rank {root}: {head}"]
    lines += ["    " + line for line in tb]
    for r in sorted(errors):
        if r == root:
            continue
        other, other_tb = _split(errors[r], r)
        if other == head:
            text = "the same error"
        elif is_consequence(errors[r]):
            text = f"{_short(other)} (after rank {root} failed)"
        elif other_tb:
            text = f"{_short(other)} (its traceback: LaunchError.errors[{r}])"
        else:
            text = _short(other)
        lines.append(f"  rank {r}: {text}")
    return "\n".join(lines)


def _split(text, rank: int) -> tuple[str, list[str]]:
    """(first line without a leading 'rank r: ', traceback lines without a repeat of it)."""
    first, *rest = str(text).splitlines() or [""]
    prefix = f"rank {rank}: "
    head = first[len(prefix):] if first.startswith(prefix) else first
    while rest and (not rest[-1].strip() or rest[-1].strip() == first.strip()):
        rest.pop()
    return head, rest


def _short(line: str) -> str:
    """One line of another rank: gloo's source path and advice, and what another rank
    posted (shown above already), left out."""
    line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    line = line.split(". This is typically")[0].split(". Reported: ")[0]
    line = re.sub(r"^(\w+: )rank \d+: ", r"\1", line)
    return line if len(line) <= LINE else line[:LINE - 3] + "..."
