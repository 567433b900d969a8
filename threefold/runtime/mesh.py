"""The device mesh: an ordered tuple of named axes, and rank coordinates on it.

A rank's coordinates are a mixed-radix number over the axes, outermost first. The default
order puts pipeline stages outermost and tensor-parallel ranks innermost (they share a node
and its fast links), which is Megatron's layout: rank = tp + tp * (dp + dp * pp). Context
parallelism sits between dp and tp, as in Megatron-Core (tp-cp-dp-pp, innermost first): its
ring sends K/V every layer, more often than dp reduces, less than tp's per-layer
all-reduces, so it gets the next-fastest links: rank = tp + tp * (cp + cp * (dp + dp * pp)).

The axes (`AXES`, one entry each; adding a kind of parallelism is one entry here plus its
rules where it is used):

    pp            pipeline stages
    dp_replicate  data-parallel replicas that hold whole copies of what dp_shard shards
                  (HSDP: replicate across nodes, shard within); 1 unless `dp_shard` < dp
    dp_shard      data-parallel ranks over which ZeRO shards optimizer state (zero=1),
                  gradients (zero=2) and parameters (zero=3); all of dp by default
    ep            expert-parallel ranks: consecutive data-parallel ranks that share their
                  tokens with all-to-all, each holding E/ep whole experts (Megatron's
                  expert-data-parallel layout: ep is the inner part of dp); 1 unless `ep`
    cp            context-parallel ranks: each holds 2 of 2*cp blocks of every sequence
                  (load-balanced for causal attention); attention is a ring over them
    tp            tensor-parallel ranks

An *alias* names a product of consecutive axes: `dp` is (dp_replicate, dp_shard, ep), the
data-parallel group that splits the batch; `edp` is (dp_replicate, dp_shard), the ranks
that hold the same experts (an expert's gradient is reduced over them, a dense one over dp). Sizes, coordinates and groups accept axes and
aliases alike; an axis a mesh does not have has size 1 (so code written for `cp` runs on
a mesh without it). A `Mesh` is a plain value; process groups built from it are passed
explicitly (runtime/comm.py), never kept globally.
"""
from __future__ import annotations

import functools

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import prod

import torch


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
class Axis:
    """One mesh axis: its name, its size under a plan, and what it is for."""
    name: str
    size_of: Callable    # plan -> size
    doc: str
    optional: bool = False   # left out of a plan's mesh at size 1 (meshes of older plans stay as they were)
    # the module path of the axis's sharding rules (its `SHARDING`, read by passes/shard.py,
    # innermost axis first); a string, since the runtime imports no pass
    rules: str = ""
    # "module:function" of the runtime op that cuts a user input placed S(d) on this axis,
    # f(tensor, d, size, index) -> this rank's part (runtime/run_plan.input_cut); "": the axis
    # cuts no user input (the batch axes' rows are cut with the microbatches, by the engine)
    cut: str = ""


# Outermost first. The rank formula is the mixed radix over this order.
AXES: tuple[Axis, ...] = (
    Axis("pp", lambda plan: plan.pp, "pipeline stages"),
    Axis("dp_replicate", lambda plan: plan.dp // plan.shard_degree,
         "data-parallel replicas of the sharded state (HSDP: across nodes)", rules="threefold.passes.mesh_axes"),
    Axis("dp_shard", lambda plan: plan.shard_degree // getattr(plan, "ep", 1),
         "data-parallel ranks that shard optimizer state, gradients, parameters (zero>=1)",
         rules="threefold.passes.mesh_axes"),
    Axis("ep", lambda plan: getattr(plan, "ep", 1),
         "expert-parallel ranks (inside dp): each holds E/ep whole experts, tokens move by all-to-all",
         optional=True, rules="threefold.passes.ep_rules"),
    Axis("cp", lambda plan: getattr(plan, "cp", 1),
         "context-parallel ranks (every sequence split along its positions; ring attention)",
         optional=True, rules="threefold.passes.context_parallel", cut="threefold.runtime.cp_ops:local_blocks"),
    Axis("tp", lambda plan: plan.tp, "tensor-parallel ranks", rules="threefold.passes.tensor_parallel"),
)
AXIS_NAMES = tuple(a.name for a in AXES)
# Products of consecutive axes, by name.
ALIASES: dict[str, tuple[str, ...]] = {"dp": ("dp_replicate", "dp_shard", "ep"),
                                       "edp": ("dp_replicate", "dp_shard")}
# The axes that split the global batch: each of their ranks trains on its share of the rows
# (or tokens), so a replicated parameter's gradient is summed over all of them and the loss's
# global denominator counts all of them. One place: the engine's gradient reduction, the
# loss seed and the denominator all read it. (A new axis that splits the data joins here.)
# cp splits the tokens of each sequence: its ranks hold different tokens of the same rows, so
# it joins (a replicated parameter's gradient is summed over dp x cp, the loss denominator
# counts the tokens of every cp rank).
BATCH_AXES = "dp+cp"


class Coord:
    """A rank's index along every axis and alias: `coord.tp`, `coord["dp"]`."""
    __slots__ = ("_index",)

    def __init__(self, index: dict[str, int]):
        object.__setattr__(self, "_index", dict(index))

    def __getitem__(self, name: str) -> int:
        return self._index.get(name, 0)

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._index.get(name, 0)

    def __setattr__(self, name, value):
        raise AttributeError("Coord is immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, Coord) and self._index == other._index

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._index.items())))

    def __repr__(self) -> str:
        return "Coord(" + ", ".join(f"{k}={v}" for k, v in self._index.items()) + ")"


class Mesh:
    """Named axes, outermost first, with their sizes: `Mesh(tp=2, dp=2, pp=2)`,
    `Mesh(dp=4, dp_shard=2)` (HSDP 2 x 2), or `Mesh.from_axes([("pp", 2), ("dp_shard", 2), ("tp", 2)])`."""
    __slots__ = ("axes", "_sizes")

    def __init__(self, **sizes: int):
        dp = sizes.pop("dp", None)
        ep = sizes.get("ep", 1)
        if dp is not None:
            if dp % ep:
                raise ValueError(f"mesh ep={ep} does not divide dp={dp}")
            dp //= ep          # ep is the inner part of dp
        shard = sizes.pop("dp_shard", None)
        replicate = sizes.pop("dp_replicate", None)
        if dp is not None:
            shard = dp if shard is None else shard
            if replicate is None:
                replicate = dp // shard if shard and dp % shard == 0 else 0
            if replicate * shard != dp:
                raise ValueError(f"mesh dp={dp} is not dp_replicate={replicate} x dp_shard={shard}")
        sizes["dp_shard"] = 1 if shard is None else shard
        sizes["dp_replicate"] = 1 if replicate is None else replicate
        unknown = set(sizes) - set(AXIS_NAMES)
        if unknown:
            raise ValueError(f"mesh axes {sorted(unknown)} are unknown: the axes are {', '.join(AXIS_NAMES)}")
        optional = {a.name for a in AXES if a.optional}
        self._set([(name, int(sizes.get(name, 1))) for name in AXIS_NAMES
                   if not (name in optional and int(sizes.get(name, 1)) == 1)])

    @classmethod
    def from_axes(cls, axes: Iterable[tuple[str, int]]) -> "Mesh":
        mesh = cls.__new__(cls)
        mesh._set([(str(n), int(s)) for n, s in axes])
        return mesh

    @classmethod
    def of_plan(cls, plan) -> "Mesh":
        """The mesh a plan runs on: every axis of AXES, sized by its rule."""
        return cls.from_axes((a.name, a.size_of(plan)) for a in AXES
                             if not (a.optional and a.size_of(plan) == 1))

    def _set(self, axes: list[tuple[str, int]]) -> None:
        names = [n for n, _ in axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axes {names} repeat a name")
        for n, s in axes:
            if s < 1:
                raise ValueError(f"mesh axis {n}={s} must be a positive integer")
        object.__setattr__(self, "axes", tuple(axes))
        object.__setattr__(self, "_sizes", dict(axes))

    def __setattr__(self, name, value):
        raise AttributeError("Mesh is immutable")

    # -- sizes -------------------------------------------------------------------------
    def _expand(self, names) -> tuple[str, ...]:
        """Axis or alias names -> the mesh's axes they cover, in mesh order."""
        if isinstance(names, str):
            names = tuple(names.split("+"))   # "dp+cp": the product of both
        wanted: set[str] = set()
        for n in names:
            wanted.update(ALIASES.get(n, (n,)))
        return tuple(n for n, _ in self.axes if n in wanted)

    def size(self, names) -> int:
        """The size of an axis, an alias or a product of them (1 for an axis not in the mesh)."""
        return prod(self._sizes[n] for n in self._expand(names))

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._sizes or name in ALIASES or name in _KNOWN_ELSEWHERE:
            return self.size(name)
        raise AttributeError(f"mesh has no axis {name!r} (axes: {', '.join(self._sizes)})")

    @property
    def world_size(self) -> int:
        return prod(s for _, s in self.axes)

    def to_json(self) -> list[list]:
        return [[n, s] for n, s in self.axes]

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self.axes == other.axes

    def __hash__(self) -> int:
        return hash(self.axes)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"

    # -- coordinates ---------------------------------------------------------------------
    def rank(self, **index: int) -> int:
        """The rank at these indices (axes or aliases; unnamed axes at 0)."""
        per_axis = {n: 0 for n, _ in self.axes}
        for name, i in index.items():
            parts = self._expand(name)
            if not parts and i:
                raise ValueError(f"mesh has no axis {name!r}")
            for n, k in zip(parts, _digits(i, [self._sizes[p] for p in parts])):
                per_axis[n] = k
        r = 0
        for n, s in self.axes:
            r = r * s + per_axis[n]
        return r

    def moved(self, rank: int, **index: int) -> int:
        """The rank with `rank`'s coordinates except along the named axes or aliases."""
        c = self.coord(rank)
        per_axis = {n: c[n] for n, _ in self.axes}
        for name in index:
            for n in self._expand(name):
                per_axis.pop(n)
        return self.rank(**per_axis, **index)

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        index: dict[str, int] = {}
        for n, s in reversed(self.axes):
            index[n] = rank % s
            rank //= s
        index = {n: index[n] for n, _ in self.axes}
        for alias, parts in ALIASES.items():
            have = [p for p in parts if p in self._sizes]
            k = 0
            for p in have:
                k = k * self._sizes[p] + index[p]
            index[alias] = k
        return Coord(index)

    # -- groups ----------------------------------------------------------------------------
    def group(self, rank: int, names) -> list[int]:
        """The ranks that differ from `rank` only along `names` (axes or aliases), in the
        order of their index along those axes (the order collectives use)."""
        axes = self._expand(names)
        c = self.coord(rank)
        fixed = {n: c[n] for n, _ in self.axes if n not in axes}
        out = []
        for k in range(self.size(axes)):
            index = dict(fixed)
            for n, d in zip(axes, _digits(k, [self._sizes[a] for a in axes])):
                index[n] = d
            out.append(self.rank(**index))
        return out

    def groups(self, names) -> list[list[int]]:
        """Every group along `names`: a partition of all ranks, in a fixed order (by first
        rank; each as `group` orders it). Every rank builds every group at start-up, so this
        is one array transpose, not a walk over the world per group."""
        return [list(g) for g in _partition(self.axes, self._expand(names))]

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank of one pipeline stage, ascending."""
        return sorted(r for r in range(self.world_size) if self.coord(r).pp == stage)

    # shorthands for the groups of the tp, dp and pp axes (any axis: `group(rank, name)`)
    def tp_group(self, rank: int) -> list[int]:
        return self.group(rank, "tp")

    def dp_group(self, rank: int) -> list[int]:
        return self.group(rank, "dp")

    def pp_group(self, rank: int) -> list[int]:
        return self.group(rank, "pp")


# Axes that other meshes may have (added by plans with more parallelism): absent, size 1.
_KNOWN_ELSEWHERE = ("ep", "edp", "cp")


@functools.lru_cache(maxsize=64)
def _partition(axes: tuple, spanned: tuple) -> tuple:
    """The rank grid with the spanned axes moved last (each keeping mesh order), one row per
    group: rows come in ascending first rank, members in their index along the spanned axes."""
    sizes = [s for _, s in axes]
    other = [i for i, (n, _) in enumerate(axes) if n not in spanned]
    span = [i for i, (n, _) in enumerate(axes) if n in spanned]
    grid = torch.arange(prod(sizes), dtype=torch.int64).reshape(sizes)
    rows = grid.permute(other + span).reshape(-1, prod(sizes[i] for i in span))
    return tuple(tuple(row) for row in rows.tolist())


def _digits(k: int, sizes: list[int]) -> list[int]:
    """k as a mixed-radix number over `sizes` (outermost first)."""
    out = []
    for s in reversed(sizes):
        out.append(k % s)
        k //= s
    return list(reversed(out))
