"""Position tables found by data flow under cp (plan `cp=N`): input-free values sliced to the
sequence read this rank's rows.

The model is traced at the local length n = s/cp, so a table (parameters, buffers, constants:
a learned position table, a rotary cache, a decay table) sliced to the sequence reads its first
n rows in the trace, where one process reads the first s. Every such slice along a dim that
covers the whole sequence becomes an index_select of this rank's global positions, under the
load-balanced layout (cp_ops.positions):
- `t[start:start + n]` (a table read from row `start`, OPT's offset 2) -> rows start + positions;
- `t[-n:]` (a table read from its end, as lightning attention's key decay `k_decay[:, -b:]`
  over a block that is the whole sequence) -> rows L - s + positions, L the table's length:
  one process reads its last s rows.
A table sliced so on two dims (a decay grid `D[:n, :n]` of positions x positions) gets both;
where it meets a value computed whole (cp_whole.py), the grid of this rank's positions is then
itself rebuilt whole (cp_free_whole.py) and no row of it is guessed. A slice whose twin in the
model traced at the whole length cuts the same rows is a constant equal to n by chance (a block
of a blockwise loop as long as the share), not the sequence: left alone.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.ops.families import args_of, op_name
from threefold.passes.cp_masks import input_free
from threefold.passes.cp_padding import padded, real_length
from threefold.runtime import cp_ops
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


def position_slices(table: fx.Node, stage) -> list:
    """The slices to the sequence in what the input-free `table` is made of: [(slice node, dim,
    first row at the whole length)], [] where there is none."""
    n, whole = stage.seq_len, real_length(stage)   # a padded sequence reads its padding as its last row
    if not isinstance(table, fx.Node) or not input_free(table):
        return []
    found, seen, stack = [], set(), [table]
    while stack:
        x = stack.pop()
        if not isinstance(x, fx.Node) or x in seen:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
        if x.op != "call_function" or op_name(x) != "slice":
            continue
        a = args_of(x)
        v, start, end = a["self"].meta.get("val"), a["start"] or 0, a["end"]
        if not isinstance(v, torch.Tensor) or not isinstance(start, int) or a["step"] != 1:
            continue
        dim = a["dim"] % v.dim()
        length = v.shape[dim]
        if length < whole:
            continue
        if start >= 0 and end == start + n and length >= start + whole:
            found.append((x, dim, start))
        elif start == -n and (end is None or end >= length):   # t[-n:]: the last rows
            found.append((x, dim, length - whole))
    return [f for f in found if not _same_at_whole(f[0], stage)]


def rows_at_positions(table: fx.Node, stage) -> list:
    """Every slice `position_slices` finds in `table` -> t.index_select(dim, first + positions):
    the rows of this rank's global positions. Returns the new nodes ([] where there is none)."""
    n, new = stage.seq_len, []
    for x, dim, first in position_slices(table, stage):
        a, graph = args_of(x), x.graph
        v = a["self"].meta["val"]
        with graph.inserting_before(x):
            pos = graph.call_function(cp_ops.positions, (n, CP), {"device": v.device, **(
                {"limit": real_length(stage)} if padded(stage) else {})})
            at = graph.call_function(torch.ops.aten.add.Tensor, (pos, first)) if first else pos
            rows = graph.call_function(torch.ops.aten.index_select.default, (a["self"], dim, at))
        pos.meta = {"val": torch.arange(n, device=v.device), "tf": dict(tf(x))}
        if first:
            at.meta = {"val": torch.arange(n, device=v.device) + first, "tf": dict(tf(x))}
            new.append(at)
        rows.meta = {"val": x.meta["val"], "tf": dict(tf(x))}
        x.replace_all_uses_with(rows)
        graph.erase_node(x)
        new += [pos, rows]
    return new


def _same_at_whole(x: fx.Node, stage) -> bool:
    """The model traced at the whole length (stage.retrace) slices the same rows of the same
    table there: its bound is a constant that equals n (a block of a blockwise loop as long as
    this rank's share, where one process runs several blocks), not the sequence's length. Slices
    are compared by the table they start from and their bounds (node names differ between the
    traces where the loop runs more blocks)."""
    if getattr(stage, "retrace", None) is None:
        return False
    try:
        graph = stage.retrace(stage.seq_len * stage.plan.cp)
    except Exception:   # the model does not trace at the whole length: no answer, no guess
        return False
    want = _rows_path(x)
    return any(_rows_path(t) == want for t in graph.nodes if t.op == "call_function" and op_name(t) == "slice")


def _rows_path(x: fx.Node) -> tuple:
    """(the value a chain of slices and aliases starts from, by name; each slice's bounds)."""
    steps = []
    while isinstance(x, fx.Node) and x.op == "call_function" and op_name(x) in ("slice", "alias"):
        a = args_of(x)
        if op_name(x) == "slice":
            steps.append((a["dim"], a["start"], a["end"], a["step"]))
        x = a["self"]
    return (x.name if isinstance(x, fx.Node) else None, tuple(reversed(steps)))
