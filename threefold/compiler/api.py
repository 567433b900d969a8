"""Compile entry points: a model or SPEC plus a plan -> a compiled Program (and sources)."""
from __future__ import annotations

from typing import Callable

from threefold.compiler.pipeline import run_passes
from threefold.compiler.program import Program
from threefold.compiler.trace import trace
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.workload import Workload, load_spec


def microbatch(values, parts: int, what: str):
    """The first of `parts` equal slices along dim 0 of each tensor (its shape is what we trace)."""
    import torch

    def one(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % parts:
            raise PlanError(f"{what}: batch size {t.shape[0]} is not divisible by dp*m={parts}; "
                            f"use a global batch that is a multiple of {parts}")
        return t[: t.shape[0] // parts]
    if isinstance(values, tuple):
        return tuple(one(v) for v in values)
    return one(values)


def compile_workload(workload: Workload | str, plan: Plan | str | None = None,
                     progress: Callable[[str], None] | None = None) -> Program:
    """Trace a workload at microbatch size and run the pass pipeline for `plan`.

    `progress(stage)` is told "trace" and then each pass's name as it starts."""
    if isinstance(workload, str):
        workload = load_spec(workload)
    workload = Workload.coerce(workload)
    plan = Plan.parse(plan)
    parts = plan.dp * plan.microbatches
    name = type(workload.model).__name__
    inputs = microbatch(tuple(workload.inputs), parts, name)
    target = microbatch(workload.target, parts, name) if workload.loss_fn is not None else None
    if progress is not None:
        progress("trace")
    prog = trace(workload.model, inputs, target, workload.loss_fn, plan)
    return run_passes(prog, progress=progress)
