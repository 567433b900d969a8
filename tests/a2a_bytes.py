"""Counting what expert parallelism's all-to-alls move, inside a launched rank."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def counting_all_to_all():
    """Yields a dict {what: input bytes} that every runtime.comm.all_to_all call in the block
    adds to (keyed by its `what` label); the real all_to_all is put back on exit."""
    from threefold.runtime import comm
    sent: dict[str, int] = {}
    real = comm.all_to_all

    def counting(out, t, out_splits, in_splits, group, what):
        sent[what] = sent.get(what, 0) + t.numel() * t.element_size()
        return real(out, t, out_splits, in_splits, group, what)
    comm.all_to_all = counting
    try:
        yield sent
    finally:
        comm.all_to_all = real
