"""Assemble one rank's engine from a manifest and loaded chunk modules (no compiler needed)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime.comm import build_groups
from threefold.runtime.engine import PipelineEngine
from threefold.runtime.mesh import Mesh
from threefold.runtime.module import ChunkModule
from threefold.runtime.schedule import make_schedule
from threefold.runtime.simulate import verify
from threefold.runtime.ties import tied_param_stages


def current_rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_world(mesh: Mesh, plan_text: str) -> int:
    rank, world = current_rank_and_world()
    if world != mesh.world_size:
        raise PlanError(f"plan {plan_text} needs tp*pp*dp={mesh.world_size} ranks but the job has "
                        f"{world}; launch {mesh.world_size} ranks or change the plan")
    return rank


def local_chunks(manifest: dict, stage: int) -> list[int]:
    return [c["index"] for c in manifest["chunks"] if c["stage"] == stage]


def tie_stage_sets(manifest: dict, pp: int) -> list[tuple[int, ...]]:
    """The distinct stage sets of tied parameters (each needs one process group)."""
    return sorted(set(tied_param_stages(manifest["chunks"], pp).values()))


def make_engine(manifest: dict, modules: dict[int, ChunkModule], rank: int,
                device: torch.device) -> PipelineEngine:
    mesh = Mesh(**manifest["mesh"])
    sched = manifest["schedule"]
    schedule = make_schedule(sched["kind"], mesh.pp, sched["microbatches"], sched["interleave"])
    verify(schedule)
    groups = build_groups(mesh, rank, tie_stage_sets(manifest, mesh.pp))
    return PipelineEngine(manifest, modules, schedule, groups, device)


def default_device() -> torch.device:
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
