"""Tied parameters across pipeline stages: which stages hold each one (one rule, read by
the group builder and the engine's gradient sync)."""
from __future__ import annotations

from threefold.runtime.mesh import stage_of


def tied_param_stages(chunks: list[dict], pp: int) -> dict[str, tuple[int, ...]]:
    """FQN -> the stages holding it, for parameters held by chunks on more than one stage
    (manifest chunk entries' `shared_params`: FQN -> holder chunks). Their gradients are
    summed over a group of exactly those stages."""
    out: dict[str, tuple[int, ...]] = {}
    for c in chunks:
        for fqn, holders in c.get("shared_params", {}).items():
            stages = tuple(sorted({stage_of(h, pp) for h in holders}))
            if len(stages) > 1:
                out[fqn] = stages
    return out
