"""Score biases that are functions of (query position, key position) under context parallelism.

A learned relative-position bias (T5's buckets -> embedding, or any such subgraph) cannot be
read from one [S, S] tensor on a rank that holds n = S/cp queries. The compiler
(passes/cp_attention_bias.py) copies the bias's subgraph once per ring step, with its query
aranges replaced by this rank's global positions and its key aranges by the positions of the
keys that visit at that step (`ring_positions`); ring attention (cp_ops.ring_attention,
`pbias`) adds block `step` to the scores of that step and returns its gradient, so autograd
carries it to the parameters the subgraph reads (summed over the blocks). Nothing about the
bias travels around the ring.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.runtime.cp_ops import block_positions


def ring_positions(n: int, step: int, group, device=None, dtype=torch.int64, layout=None,
                   pin_memory=None) -> torch.Tensor:
    """Global positions of the n keys this rank meets at ring step `step` (those of cp rank
    (r - step) mod cp; step 0: this rank's own positions, its queries')."""
    cp = 1 if group is None else dist.get_world_size(group)
    r = 0 if group is None else dist.get_rank(group)
    return block_positions(n, cp, (r - step) % cp, device=device, dtype=dtype or torch.int64)
