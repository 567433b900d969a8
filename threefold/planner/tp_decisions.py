"""What the tensor-parallel pass decided, read off the program it returns.

The planner does not guess which matmuls are column- or row-parallel or which parameters
are sharded: it runs the compiler's own pass (`passes.tensor_parallel`) at a trial degree
and reads its decisions. This file is the planner's one window onto them, so when the
compiler's annotations change form only this file follows:

  * `sharded_params`: parameters the pass splits (`Program.shard_fns`, FQN -> ShardSpec);
  * `is_split(node)`: a value held as shards or partial sums (placement S(..) or P);
  * `shard_sizes(node, t)`: the global sizes the pass split for a value (tp must divide them);
  * `forward_allreduces(node)`: the tp all-reduces a communication node runs in forward;
  * `is_communication(node)`: a pure collective the pass inserted (f, g, scatter, ...).
"""
from __future__ import annotations

import torch.fx as fx

from threefold import placement as placements

from threefold.ir.program import meta_of, tf
from threefold.ir.stages import Program
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.runtime import tp_ops

TRIAL_DEGREES = (2, 3)   # the first the pass accepts is used; tp=1 only if none is
_COMMUNICATION = {tp_ops.f, tp_ops.g, tp_ops.scatter, tp_ops.gather, tp_ops.reduce_scatter,
                  tp_ops.all_gather_seq, tp_ops.scatter_blocks, tp_ops.gather_blocks}


def shard_program(traced: Program) -> tuple[Program, int]:
    """The traced program after the tensor-parallel pass at the first trial degree it accepts
    (Megatron's setting: no sequence parallelism), and that degree; (traced, 1) when it
    accepts none. `traced` itself is left as it was."""
    # lazy: start-up: threefold.passes.tensor_parallel loads 19 more modules only when this runs
    from threefold.passes.tensor_parallel import tensor_parallel
    for t in TRIAL_DEGREES:
        trial = traced.evolve(plan=Plan(tp=t), notes=(), pass_log=())
        try:
            return tensor_parallel(trial), t
        except PlanError:
            continue
    return traced, 1


def sharded_params(prog: Program) -> dict:
    return dict(prog.shard_fns)


def placement(node: fx.Node):
    """The pass's typed placement of a value (threefold.placement); R where it wrote none."""
    return tf(node).get("placement") or placements.R


def is_split(node: fx.Node) -> bool:
    return placements.is_split(placement(node))


def shard_sizes(node: fx.Node, t: int) -> set[int]:
    """Global sizes of the dims the pass split this value on (each block of a fused one)."""
    meta = meta_of(node)
    sizes: set[int] = set()
    for s in placements.shards(placement(node)):
        if s.blocks:
            sizes |= set(s.blocks)
        elif meta is not None and meta.shape:
            sizes.add(int(meta.shape[s.dim]) * t)
    return sizes


def _field(collective, name: str, default=None):
    if isinstance(collective, dict):
        return collective.get(name, default)
    return getattr(collective, name, default)


def forward_allreduces(node: fx.Node) -> tuple[int, int]:
    """(all-reduces, elements each) this node runs over the tp group in forward."""
    c = tf(node).get("collective")
    if not c or _field(c, "group") != "tp" or str(_field(c, "kind")) != "all_reduce" \
            or str(_field(c, "phase")) != "forward":
        return 0, 0
    return int(_field(c, "count", 1)), int(_field(c, "elements", 0))


def is_communication(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _COMMUNICATION
