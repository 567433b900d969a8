"""Tied parameters across pipeline stages: which stages hold each one (one rule, read by
the group builder and the engine's gradient sync)."""
from __future__ import annotations

from threefold.runtime.mesh import stage_of


def tied_param_stages(chunks, pp: int, layout: str = "loop") -> dict[str, tuple[int, ...]]:
    """FQN -> the stages holding it, for parameters held by chunks on more than one stage
    (manifest `ChunkEntry.shared_params`: FQN -> holder chunks). Their gradients are
    summed over a group of exactly those stages. `layout`: the chunk placement (mesh.LAYOUTS)."""
    out: dict[str, tuple[int, ...]] = {}
    for c in chunks:
        shared = c.shared_params if hasattr(c, "shared_params") else c.get("shared_params", {})  # JSON form too
        for fqn, holders in shared.items():
            stages = tuple(sorted({stage_of(h, pp, layout) for h in holders}))
            if len(stages) > 1:
                out[fqn] = stages
    return out
