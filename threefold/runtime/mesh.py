"""Rank coordinates in Megatron's layout: rank = tp_rank + tp * (dp_rank + dp * pp_rank).

Tensor-parallel ranks are adjacent (they share a node and its fast links), data-parallel
replicas come next, pipeline stages are outermost. A `Mesh` is a plain value; process
groups built from it are passed explicitly (see runtime/comm.py), never kept globally.
"""
from __future__ import annotations

from dataclasses import dataclass


# How model chunks sit on stages. "loop" (Megatron's interleaved assignment, every schedule
# but ZB-V): stage r holds chunks r, r+pp, r+2pp, ... "v" (ZB-V, Qi et al. 2401.10241): two
# chunks per stage in a V, stage s holds chunks s and 2pp-1-s, so the loss chunk sits on
# stage 0 next to the first chunk and the turn of the V is a local hand-over on stage pp-1.
LAYOUTS = ("loop", "v")


def chunk_layout(schedule: str) -> str:
    """The chunk layout a schedule kind runs on (the one place that maps schedules to layouts)."""
    return "v" if str(schedule).lower() == "zbv" else "loop"


def stage_of(chunk: int, pp: int, layout: str = "loop") -> int:
    """The pipeline stage that holds model chunk `chunk` under `layout` (see LAYOUTS).
    The one place this rule lives."""
    if layout == "v":
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


@dataclass(frozen=True)
class Coord:
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Mesh:
    tp: int = 1
    dp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coord(tp=tp, dp=dp, pp=pp)

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank of one pipeline stage (all its tp and dp ranks), ascending."""
        return sorted(self.rank(t, d, stage) for d in range(self.dp) for t in range(self.tp))

    def tp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(t, c.dp, c.pp) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.tp, d, c.pp) for d in range(self.dp)]

    def pp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.tp, c.dp, p) for p in range(self.pp)]

    def all_tp_groups(self) -> list[list[int]]:
        return [self.tp_group(self.rank(0, d, p)) for p in range(self.pp) for d in range(self.dp)]

    def all_dp_groups(self) -> list[list[int]]:
        return [self.dp_group(self.rank(t, 0, p)) for p in range(self.pp) for t in range(self.tp)]

    def all_pp_groups(self) -> list[list[int]]:
        return [self.pp_group(self.rank(t, d, 0)) for d in range(self.dp) for t in range(self.tp)]
