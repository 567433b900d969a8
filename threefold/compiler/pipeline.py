"""The compiler's one ordered list of passes, and the runner that applies them.

Each pass is `def name(prog: Program) -> Program`. The runner times every pass, checks the
program's invariants after it, and when one fails says which pass and which ran before.
THREEFOLD_DEBUG_DIR=dir writes the program after each pass as dir/NN_<pass>.txt.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

from threefold.compiler.cost import annotate_costs
from threefold.compiler.program import Program, format_program, tf
from threefold.errors import PlanError
from threefold.passes.batch_stats import check_batch_statistics
from threefold.passes.extract_chunks import extract_chunks
from threefold.passes.fusion import fuse
from threefold.passes.loss_form import loss_form
from threefold.passes.pipeline_split import split_pipeline
from threefold.passes.random_ops import seed_random_ops
from threefold.passes.recompute import plan_recompute
from threefold.passes.tensor_parallel import tensor_parallel

Pass = Callable[[Program], Program]


def default_passes() -> list[Pass]:
    """The standard lowering, in order. Costs are of local (per-tp-rank) shapes, so they
    come after tensor parallelism; fusion works on each chunk's own graph. The loss's
    combination over microbatches and the batch-statistics check read the traced graph.
    Recomputation marks segments of the final chunk graphs (random ops already seeded, so a
    recomputed dropout calls the same seeded op)."""
    return [check_batch_statistics, loss_form, tensor_parallel, annotate_costs, split_pipeline, extract_chunks, fuse,
            seed_random_ops, plan_recompute]


class PassFailed(RuntimeError):
    pass


def run_passes(prog: Program, passes: list[Pass] | None = None,
               progress: Callable[[str], None] | None = None) -> Program:
    """Apply `passes` (default: the standard list) in order; `progress(name)` is told each
    pass's name before it runs (the CLI shows it)."""
    passes = default_passes() if passes is None else passes
    debug_dir = os.environ.get("THREEFOLD_DEBUG_DIR")
    if debug_dir:
        os.makedirs(debug_dir, exist_ok=True)
        _dump(debug_dir, 0, "traced", prog)
    done: list[str] = []
    for i, p in enumerate(passes, start=1):
        name = p.__name__
        if progress is not None:
            progress(name)
        start = time.perf_counter()
        try:
            prog = p(prog)
            check_invariants(prog)
        except PlanError:
            raise
        except Exception as exc:
            raise PassFailed(f"pass {name} failed after [{', '.join(done)}]: "
                             f"{type(exc).__name__}: {exc}") from exc
        prog.pass_log.append((name, time.perf_counter() - start))
        done.append(name)
        if debug_dir:
            _dump(debug_dir, i, name, prog)
    return prog


def check_invariants(prog: Program) -> None:
    """What every pass must leave true: a well-formed graph with shapes everywhere."""
    prog.graph.lint()
    for node in prog.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            raise AssertionError(f"node {node.name} has no shape (meta['val'])")
        if node.op == "placeholder" and tf(node).get("kind") not in ("param", "buffer", "input"):
            raise AssertionError(f"placeholder {node.name} has no kind")
    if prog.chunks:
        covered = [name for c in prog.chunks for name in c.nodes]
        if len(covered) != len(set(covered)):
            raise AssertionError("a node belongs to two chunks")
        for c in prog.chunks:
            if c.gm is not None:
                c.gm.graph.lint()


def _dump(debug_dir: str, index: int, name: str, prog: Program) -> None:
    with open(os.path.join(debug_dir, f"{index:02d}_{name}.txt"), "w") as f:
        f.write(format_program(prog) + "\n")
        for c in prog.chunks:
            if c.gm is not None:
                f.write(f"\n# chunk {c.index}\n{c.gm.graph}\n")


def compile_program(prog: Program) -> Program:
    with torch.no_grad():
        return run_passes(prog)
