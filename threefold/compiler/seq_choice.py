"""The sequence dim of an input, from data flow, where its sizes leave several candidates (cp).

An input [b, 64, 32] under cp=2 has two dims the 2*cp = 4 blocks divide. Which one runs along
the sequence is a fact of the graph, not of the sizes: a dim that a parameter contraction
reduces over (a linear layer's input features) cannot be cut, since the weight keeps its
whole width and the trace on this rank's share fails; a dim that ops mix without a cp rule is
refused by the sequence rules (passes/cp_rules/). So each candidate is compiled in turn, and
the one candidate that compiles is the sequence. Where several compile, one without any
all-gather fallback is preferred when it is the only such; where that does not decide, the
workload must say (the one-line PlanError of seq_dims.find_seq_dims), as before.
"""
from __future__ import annotations

from typing import Callable

from threefold.errors import PlanError
from threefold.passes.seq_dims import AmbiguousSeq


def compile_each_candidate(exc: AmbiguousSeq, compile_with: Callable, inner: Callable | None = None):
    """`compile_with({input index: dim})` for each candidate dim of exc: the program of the only
    one that compiles (with a note saying why), else re-raise exc; where none compiles,
    `inner(cause)`: cp from where the sequence is born inside the model (a patch embedding;
    compiler/seq_inner.py), which raises `cause` where it is not."""
    done, failed = [], []
    for d in exc.candidates:
        try:
            done.append((d, compile_with({exc.index: d})))
        except Exception as err:   # this dim is not the sequence: the trace or a pass fails on it
            failed.append(f"dim {d}: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
    if len(done) > 1:   # a dim 2cp divides before one it pads (passes/cp_padding.py), then no fallback
        unpadded = [(d, p) for d, p in done if d not in getattr(exc, "padded", [])]
        done = unpadded if unpadded else done
    if len(done) > 1:
        position_wise = [(d, p) for d, p in done if not any(n.startswith("cp fallback:") for n in p.notes)]
        done = position_wise if len(position_wise) == 1 else done
    if not done and inner is not None:
        return inner(PlanError(f"{str(exc).split(':')[0]}: no dim of input {exc.index} is the sequence (cutting any "
                               f"of dims {exc.candidates} fails: {'; '.join(failed)})"))
    if len(done) != 1:
        raise exc
    d, prog = done[0]
    note = (f"cp: input {exc.index}'s sequence is dim {d}, the only one of its candidates {exc.candidates} that "
            f"compiles ({'; '.join(failed) or 'the others need an all-gather fallback'})")
    return prog.evolve(notes=prog.notes + (note,))
