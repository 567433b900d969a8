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


# -- where a shard sits in the full tensor (checkpoint/layout.py writes in it; grad_norm counts by it)

@dataclass(frozen=True)
class Piece:
    local: int     # start along dim in this rank's tensor
    length: int
    start: int     # start along dim in the full tensor


def _chunk(size: int, t: int, r: int) -> tuple[int, int]:
    """torch.chunk's r-th piece of `size` in t parts: (start, length)."""
    c = -(-size // t)
    start = min(r * c, size)
    return start, max(0, min(size, start + c) - start)


def pieces(spec: ShardSpec | None, full_shape, tp_rank: int, owned: bool = False) -> tuple[int, list[Piece]]:
    """(dim, pieces) of tp rank `tp_rank`'s shard of a tensor of `full_shape`. A block every
    rank holds whole is a piece of each (loads fill it everywhere, DCP writes it once); with
    `owned`, of tp rank 0 only (what a sum over ranks must count once)."""
    full_shape = list(full_shape)
    if spec is None:
        return 0, [Piece(0, full_shape[0] if full_shape else 1, 0)]
    dim, t = spec.dim, spec.t
    out: list[Piece] = []
    if spec.blocks:
        local, offset = 0, 0
        for b, whole in zip(spec.blocks, spec.whole or (False,) * len(spec.blocks)):
            start, n = (0, b) if whole else _chunk(b, t, tp_rank)
            if not (whole and owned and tp_rank):
                out.append(Piece(local, n, offset + start))
            local, offset = local + n, offset + b
        return dim, [p for p in out if p.length]
    start, n = _chunk(spec.padded, t, tp_rank)
    real = max(0, min(full_shape[dim], start + n) - start)   # rows past the real size: padding
    return dim, [Piece(0, real, start)] if real else []


def local_shape(spec: ShardSpec | None, full_shape, tp_rank: int) -> list[int]:
    shape = list(full_shape)
    if spec is not None:
        whole = spec.whole or (False,) * len(spec.blocks)
        shape[spec.dim] = (sum(b if w else _chunk(b, spec.t, tp_rank)[1] for b, w in zip(spec.blocks, whole))
                           if spec.blocks
                           else _chunk(spec.padded, spec.t, tp_rank)[1])
    return shape
