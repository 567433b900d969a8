"""Refuse what cannot equal one process: batch statistics over a batch that is split.

A training-mode BatchNorm normalises with the mean and variance of the rows it sees. With
m*dp > 1 each microbatch on each dp rank would see only its own rows, so the activations,
the loss and the running statistics would all differ from one process. We do not offer
synchronised statistics (they would need a collective inside every forward); the user
chooses m=1 and dp=1, or opts in to per-microbatch statistics with batchnorm=local.
"""
from __future__ import annotations

from threefold.compiler.contracts import stage_pass
from threefold.compiler.program import tf
from threefold.compiler.stages import Traced
from threefold.errors import PlanError

# op name -> index of its `training` argument
_BATCH_STAT_OPS = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                   "_native_batch_norm_legit_functional": 5, "cudnn_batch_norm": 5,
                   "miopen_batch_norm": 5, "_batch_norm_impl_index": 5,
                   "_batch_norm_with_update": -1, "_batch_norm_with_update_functional": -1}


@stage_pass(needs=Traced)
def check_batch_statistics(prog: Traced) -> Traced:
    """Needs: a traced graph. Guarantees: no training-mode batch statistics over a split
    batch, unless the plan says batchnorm=local (then a note says so)."""
    parts = prog.plan.dp * prog.plan.microbatches
    notes = []
    for node in prog.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        name = schema.name.split("::")[-1] if schema is not None else ""
        if name not in _BATCH_STAT_OPS:
            continue
        idx = _BATCH_STAT_OPS[name]
        training = True if idx < 0 else (node.args[idx] if idx < len(node.args) else node.kwargs.get("training"))
        if not training or parts == 1:
            continue
        where = tf(node).get("module", "") or "<top>"
        if prog.plan.batchnorm == "local":
            note = (f"batchnorm=local: {where} ({name}) uses per-microbatch batch statistics "
                    f"({parts} microbatches x dp ranks), not the global batch's")
            if note not in prog.notes and note not in notes:
                notes.append(note)
            continue
        raise PlanError(f"{prog.name}: module {where!r} (aten.{name}) computes batch statistics in "
                        f"training mode, which with m*dp={parts} would be per microbatch, not over the "
                        "global batch; use m=1 and dp=1, put the module in eval mode, or set "
                        "batchnorm=local in the plan to accept per-microbatch statistics")
    return prog.noted(*notes)
