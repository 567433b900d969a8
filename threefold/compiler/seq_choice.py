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

import torch

from threefold.errors import PlanError
from threefold.ops.families import args_of, op_name
from threefold.passes.seq_dims import AmbiguousSeq


def compile_each_candidate(exc: AmbiguousSeq, compile_with: Callable, traced_whole: Callable | None = None,
                           cp: int = 1):
    """`compile_with({input index: dim})` for each candidate dim of exc: the program of the only
    one that compiles (with a note saying why), else re-raise exc; where none compiles and
    `traced_whole()` (the model's graph at cp=1) shows the sequence made inside the model (a
    patch embedding), a PlanError saying so instead."""
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
    if not done and traced_whole is not None:
        inner = _inner_sequence(traced_whole, cp)
        if inner is not None:
            raise PlanError(f"{str(exc).split(':')[0]}: cp={cp}: no dim of input {exc.index} is the sequence (cutting "
                            f"any of dims {exc.candidates} fails); {inner}") from None
    if len(done) != 1:
        raise exc
    d, prog = done[0]
    note = (f"cp: input {exc.index}'s sequence is dim {d}, the only one of its candidates {exc.candidates} that "
            f"compiles ({'; '.join(failed) or 'the others need an all-gather fallback'})")
    return prog.evolve(notes=prog.notes + (note,))


def _inner_sequence(traced_whole: Callable, cp: int):
    """Where the sequence is made inside the model: the first attention's query length and
    module, as a reason (None where the model has no attention, or does not trace)."""
    try:
        graph = traced_whole()
    except Exception:   # no answer, no guess
        return None
    for node in graph.nodes:
        name = op_name(node) if node.op == "call_function" else None
        if name == "scaled_dot_product_attention":
            q = args_of(node)["query"].meta.get("val")
        elif name in ("softmax", "_softmax") and op_name(node.args[0]) in ("matmul", "bmm", "mul", "div", "add"):
            q = node.meta.get("val")
        else:
            continue
        if not isinstance(q, torch.Tensor) or q.dim() < 2:
            continue
        length, module = q.shape[-2], node.meta.get("tf", {}).get("module") or "<top>"
        why = f"the sequence appears inside the model ({length} tokens at the attention in {module}, made from the input)"
        if length % (2 * cp):
            return f"{why}, and {length} is not a multiple of 2*cp={2 * cp}; use cp=1"
        return f"{why}; cp splits a sequence the inputs carry: use cp=1"
    return None
