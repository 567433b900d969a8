"""Typed values the passes attach to graph nodes under `node.meta["tf"]`.

The keys a node may carry, and who writes them:
  kind         placeholder kind: 'param' | 'buffer' | 'input' | 'boundary'  (trace, split)
  fqn          a param/buffer placeholder's canonical FQN                   (trace)
  input_index  a user input's position in the batch                         (trace)
  frozen       a requires_grad=False parameter                             (trace)
  module       the source module's FQN                                     (trace)
  placement    a threefold.placement value (Replicate, Shard, ...)         (tensor_parallel)
  collective   a Collective (below)                                        (tensor_parallel)
  cost         a passes.cost.NodeCost                                    (annotate_costs)
  chunk        the chunk index of a compute node                           (split_pipeline)
  recomputed   a free value copied into this chunk                         (split_pipeline)
  fused        the kernel name of a fused region node                      (fuse)
Every value is immutable and hashable, so the runner's fingerprint of a stage sees any change.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    """A tensor-parallel collective a node runs, per microbatch (for inspect and the planner)."""
    kind: str                    # all_reduce | all_gather | reduce_scatter
    phase: str                   # forward | backward: when `kind` runs
    elements: int                # elements of the value it moves
    group: str = "tp"
    backward: str | None = None  # the collective its backward runs, if it has one
    count: int = 1               # how many times per call (a vocab-parallel CE reduces twice)
    # backward runs `kind` again: autograd kept the input shard, not this collective's output
    # (sequence all-gathers: runtime/saved_shards.py)
    regathers: bool = False

    def get(self, name: str, default=None):
        """Dict-style read, for callers written against the old dict form."""
        return getattr(self, name, default)
