"""Find each user input's sequence dimension, for context parallelism (plan cp=N).

The batch dim is found first (passes/batch_dims.py). The sequence length S is read from the
first model input that has a dim besides its batch dim: its one such dim whose size 2*cp
divides (the load-balanced layout cuts each sequence into 2*cp blocks); where it has several,
the workload must say (a PlanError). Every input (and the target) is split along its one
non-batch dim of size S; an input without one is not split, one with two is refused. The
graph check (passes/cp_rules.py) then proves the choice: a wrong dim meets an op with no rule.
"""
from __future__ import annotations

import torch

from threefold.errors import PlanError


def find_seq_dims(batch: tuple, batch_dims: list, num_model_inputs: int, cp: int, name: str = "") -> list:
    """One entry per batch entry: its sequence dim, or None where it is not split."""
    if cp == 1:
        return [None] * len(batch)
    batch_dims = [0 if d is None else d for d in batch_dims]   # not split (dp*m = 1): dim 0
    length = None
    for i, t in enumerate(batch[:num_model_inputs]):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue
        cands = [d for d in range(t.dim()) if d != batch_dims[i] and t.shape[d] % (2 * cp) == 0]
        if len(cands) != 1:
            others = [d for d in range(t.dim()) if d != batch_dims[i]]
            if len(others) == 1:
                raise PlanError(f"{name}: cp={cp} splits the sequence into 2*cp={2 * cp} blocks, but input "
                                f"{i} has {t.shape[others[0]]} positions (dim {others[0]}); use a sequence "
                                f"length that is a multiple of {2 * cp}")
            raise PlanError(f"{name}: cp={cp} cannot tell the sequence dim of input {i} {tuple(t.shape)} "
                            f"(candidates {cands}); pass the sequence as the one non-batch dim divisible by {2 * cp}")
        length = t.shape[cands[0]]
        break
    if length is None:
        raise PlanError(f"{name}: cp={cp} needs a model input with a sequence dim (besides the batch dim)")
    out = []
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            out.append(None)
            continue
        dims = [d for d in range(t.dim()) if d != batch_dims[i] and t.shape[d] == length]
        if len(dims) > 1:
            raise PlanError(f"{name}: input {i} {tuple(t.shape)} has {len(dims)} dims of the sequence length "
                            f"{length}; cp cannot tell which to split (a [seq, seq] mask?): use cp=1")
        out.append(dims[0] if dims else None)
    return out


def local_share(values: tuple, dims: list, cp: int) -> tuple:
    """The first cp rank's share of each value (blocks 0 and 2cp-1): its shape is what we trace."""
    # lazy: start-up: runtime.cp_ops loads only on this path
    from threefold.runtime.cp_ops import local_blocks
    return tuple(local_blocks(v, d, cp, 0) if d is not None and isinstance(v, torch.Tensor) else v
                 for v, d in zip(values, dims))
