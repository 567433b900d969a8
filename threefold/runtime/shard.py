"""Cut one tensor-parallel rank's piece of a full parameter (runtime side, no compiler).

A `ShardSpec` is what the tensor-parallel pass decided for a parameter: the dim it is
split on, the pieces of a fused projection (`blocks`, each split separately so every rank
gets its own q, k and v), and the padded size of a vocabulary t does not divide. It is
stored in the manifest, so any rank can cut its shard from the full weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    blocks: tuple[int, ...]
    padded: int
    t: int
    whole: tuple[bool, ...] = ()   # per block: every rank holds it whole (a fused projection's
                                   # single key/value head beside its sharded queries)

    def __call__(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        if self.blocks:
            pieces = full.split(list(self.blocks), dim=self.dim)
            whole = self.whole or (False,) * len(pieces)
            return torch.cat([p if w else p.chunk(self.t, dim=self.dim)[rank] for p, w in zip(pieces, whole)],
                             dim=self.dim).contiguous()
        size = full.shape[self.dim]
        if self.padded != size:
            shape = list(full.shape)
            shape[self.dim] = self.padded - size
            full = torch.cat([full, full.new_zeros(shape)], dim=self.dim)
        return full.chunk(self.t, dim=self.dim)[rank].contiguous()

    def to_json(self) -> dict:
        out = {"dim": self.dim, "blocks": list(self.blocks), "padded": self.padded, "t": self.t}
        if any(self.whole):
            out["whole"] = list(self.whole)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "ShardSpec":
        return cls(d["dim"], tuple(d["blocks"]), d["padded"], d["t"], tuple(d.get("whole", ())))


def rank_shard(full: torch.Tensor, spec: ShardSpec | None, tp_rank: int) -> torch.Tensor:
    """One tp rank's piece of a full parameter or buffer: cut by its spec, whole if none.
    The one rule for cutting a rank's weights (artifacts, parallelize and checkpoints)."""
    return full if spec is None else spec(full, tp_rank)


def rank_state(full: dict[str, torch.Tensor], fqns, specs: dict, tp_rank: int) -> dict[str, torch.Tensor]:
    """The tensors `fqns` for one tp rank, keyed by FQN, cut from the full state."""
    return {fqn: rank_shard(full[fqn], specs.get(fqn), tp_rank) for fqn in fqns}
