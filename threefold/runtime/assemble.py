"""Assemble one rank from a manifest: its chunk modules, their weight shards, its process
groups, its verified schedule, and the engine that runs them.

The one path every entry point takes (`threefold.parallelize`, `threefold run`, `threefold
check` through parallelize). They differ only in where modules and weights come from,
which a *source* answers (no compiler needed, so a saved artifact runs with the runtime
alone):

    source.chunk_class(entry) -> the ChunkModule subclass of a manifest chunk entry
    source.load_weights(module, entry, tp_rank, device) -> fill the module with its shard

`runtime/loader.ArtifactSource` reads checked files of an artifact; `api.py` serves the
sources it generated in memory and the model's own weights (or a safetensors file).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime.collective_plan import plan_collectives, with_collectives
from threefold.runtime.comm import GROUP_AXES, build_groups
from threefold.runtime.engine import PipelineEngine
from threefold.runtime.expert_modules import keep_local_modules
from threefold.runtime.experts import keep_local_experts
from threefold.runtime.manifest import ChunkEntry, Manifest
from threefold.runtime.mesh import Mesh, chunk_layout
from threefold.runtime.module import ChunkModule
from threefold.runtime.schedule import make_schedule
from threefold.runtime.simulate import verify
from threefold.runtime.ties import tied_param_stages
from threefold.runtime.zero import ROW_PEER_GROUPS


class RankSource(Protocol):
    def chunk_class(self, entry: ChunkEntry) -> type[ChunkModule]: ...

    def load_weights(self, module: ChunkModule, entry: ChunkEntry, tp_rank: int,
                     device: torch.device) -> None: ...


def assemble_rank(manifest: Manifest, source: RankSource, rank: int | None = None,
                  device=None) -> PipelineEngine:
    """This rank's engine (parallelize wraps it in a ParallelModule). `rank` defaults to the job's (checked against the plan's
    world size); `device` to the process group's (CUDA under NCCL, else CPU)."""
    mesh = manifest.mesh
    if rank is None:
        rank = check_world(mesh, str(manifest.plan))
    dev = torch.device(device) if device is not None else default_device()
    coord = mesh.coord(rank)
    modules: dict[int, ChunkModule] = {}
    for c in manifest.local_chunks(coord.pp):
        entry = manifest.chunks[c]
        module = source.chunk_class(entry)(device=dev)
        source.load_weights(module, entry, coord.tp, dev)
        if mesh.ep > 1:   # this rank's E/ep whole experts (runtime/experts.py)
            keep_local_experts(module, coord.ep, mesh.ep)
            keep_local_modules(module, coord.ep, mesh.ep)
        modules[c] = module
    schedule, collectives = step_schedule(manifest)
    axes = GROUP_AXES + (ROW_PEER_GROUPS if collectives.zero >= 1 else ()) + (
        ("dp_shard#rs",) if collectives.zero >= 2 else ())
    groups = build_groups(mesh, rank, tie_stage_sets(manifest), axes)
    return PipelineEngine(manifest, modules, schedule, groups, dev, collectives)


def step_schedule(manifest: Manifest):
    """The verified schedule of one training step, its collectives included, and the
    collective plan it was built from (the same on every rank)."""
    plan = manifest.plan
    base = make_schedule(plan.schedule, manifest.mesh.pp, plan.microbatches, plan.interleave)
    collectives = plan_collectives(manifest, base)
    schedule = with_collectives(base, collectives)
    verify(schedule)
    return schedule, collectives


def tie_stage_sets(manifest: Manifest) -> list[tuple[int, ...]]:
    """The distinct stage sets of tied parameters (each needs one process group)."""
    layout = chunk_layout(manifest.plan.schedule)
    return sorted(set(tied_param_stages(manifest.chunks, manifest.mesh.pp, layout).values()))


def current_rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_world(mesh: Mesh, plan_text: str) -> int:
    """This process's rank, after checking the job has exactly the plan's world size."""
    rank, world = current_rank_and_world()
    if world != mesh.world_size:
        raise PlanError(f"plan {plan_text} needs {mesh.world_size} ranks (the product of its mesh axes) but the job has "
                        f"{world}; launch {mesh.world_size} ranks or change the plan")
    return rank


def default_device() -> torch.device:
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
