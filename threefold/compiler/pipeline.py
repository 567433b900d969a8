"""The compiler's one ordered list of passes, and the runner that applies them.

A pass is a function from one stage to a new one (ir/stages.py), declared with
`@stage_pass(needs=..., gives=..., requires=..., guarantees=...)` (ir/contracts.py).
The runner times every pass; checks its input's type and `requires`, that the input is
unchanged afterwards, and the output's type, well-formedness and `guarantees`; and when
anything fails says which pass and which ran before. THREEFOLD_DEBUG_DIR=dir writes every
stage as a reloadable directory dir/NN_<pass>/ (ir/stage_io.py) beside a readable
dir/NN_<pass>.txt. Adding a pass: write it, decorate it, put it in `default_passes`.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

from threefold.ir.contracts import CHECKS, ContractError, fingerprint, spec_of, well_formed
from threefold.passes.cost import annotate_costs
from threefold.ir.stages import Stage
from threefold.errors import PlanError
from threefold.ir.program import format_stage
from threefold.passes.batch_coupling import check_batch_coupling
from threefold.passes.experts import find_experts
from threefold.passes.fusion import fuse
from threefold.passes.loss_form import loss_form
from threefold.passes.pipeline_split import split_pipeline
from threefold.passes.random_ops import seed_random_ops
from threefold.passes.recompute import plan_recompute
from threefold.passes.static_shapes import check_static_shapes
from threefold.passes.shard import shard, shard_chunks, shard_local
from threefold.passes.shard_units import plan_shard_units

Pass = Callable[[Stage], Stage]


def default_passes() -> list[Pass]:
    """The standard lowering, in order. Costs are of local (per-tp-rank) shapes, so they
    come after tensor parallelism; split_pipeline gives each chunk its own graph and fusion
    works on those. The batch-coupling check (ops that mix batch rows) and the loss's
    combination over microbatches read the traced graph. Recomputation marks segments of the final chunk graphs (random
    ops already seeded, so a recomputed dropout calls the same seeded op). ZeRO-2/3 units
    group the final chunk graphs' parameters by layer. Expert regions are found in the final
    chunk graphs (a pipeline cut between two expert matmuls leaves a region on each side).
    The sharding walker (passes/shard.py) applies every axis's rules where their facts are
    known: `shard_local` rewrites the traced graph at tp's local shapes, `shard` on the sharded graph (cp rewrites attention there: the tp rules saw the
    plain ops, the ring runs per head shard; then the batch axes), `shard_chunks` once expert
    regions are found (ep). Which axes, in which order, is the mesh's table (runtime/mesh.py)."""
    return [check_static_shapes, check_batch_coupling, loss_form, shard_local, shard, annotate_costs,
            split_pipeline, fuse, seed_random_ops, find_experts, shard_chunks, plan_recompute, plan_shard_units]


class PassFailed(RuntimeError):
    pass


def run_passes(stage: Stage, passes: list[Pass] | None = None,
               progress: Callable[[str], None] | None = None) -> Stage:
    """Apply `passes` (default: the standard list) in order; `progress(name)` is told each
    pass's name before it runs (the CLI shows it)."""
    passes = default_passes() if passes is None else passes
    debug_dir = os.environ.get("THREEFOLD_DEBUG_DIR")
    if debug_dir:
        os.makedirs(debug_dir, exist_ok=True)
        _dump(debug_dir, 0, "traced", stage)
    done: list[str] = []
    for i, p in enumerate(passes, start=1):
        name = p.__name__
        if progress is not None:
            progress(name)
        spec = spec_of(p)

        def failed(what: str, exc: BaseException | None = None) -> PassFailed:
            return PassFailed(f"pass {name} failed after [{', '.join(done)}]: {what}")
        if not isinstance(stage, spec.needs):
            raise failed(f"needs a {spec.needs.__name__} stage, got {type(stage).__name__}")
        try:
            for check in spec.requires:
                CHECKS[check](stage)
        except ContractError as exc:
            raise failed(f"its input does not satisfy {check!r}: {exc}") from exc
        start = time.perf_counter()
        before = fingerprint(stage)
        try:
            out = p(stage)
        except PlanError:
            raise
        except Exception as exc:
            raise failed(f"{type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        if fingerprint(stage) != before:
            raise failed("it changed its input stage in place; copy a graph before rewriting it "
                         "(stages.copy_graph_module) and return a new stage")
        if not isinstance(out, spec.gives):
            raise failed(f"returned {type(out).__name__}, but declares {spec.gives.__name__}")
        try:
            well_formed(out)
            for check in spec.guarantees:
                CHECKS[check](out)
        except ContractError as exc:
            raise failed(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # a graph that does not lint
            raise failed(f"{type(exc).__name__}: {exc}") from exc
        stage = out.evolve(pass_log=out.pass_log + ((name, seconds),))
        done.append(name)
        if debug_dir:
            _dump(debug_dir, i, name, stage)
    return stage


def _dump(debug_dir: str, index: int, name: str, stage: Stage) -> None:
    from threefold.ir.stage_io import save_stage   # lazy: start-up: ir.stage_io loads only on this path
    with open(os.path.join(debug_dir, f"{index:02d}_{name}.txt"), "w") as f:
        f.write(format_stage(stage) + "\n")
    save_stage(stage, os.path.join(debug_dir, f"{index:02d}_{name}"))


def compile_program(stage: Stage) -> Stage:
    with torch.no_grad():
        return run_passes(stage)
