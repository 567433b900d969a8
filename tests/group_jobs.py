"""Rank functions for tests/test_group_reuse.py (launched on gloo ranks)."""
from __future__ import annotations

import os


def groups_of_three_builds(plan: str) -> tuple:
    """Build a plan's groups three times: (threads after the first, after the third, whether
    every axis got the same group object each time)."""
    import torch.distributed as dist
    from threefold.plan import Plan
    from threefold.runtime.comm import build_groups
    mesh, rank = Plan.parse(plan).mesh, dist.get_rank()
    threads = lambda: len(os.listdir(f"/proc/{os.getpid()}/task"))
    first = build_groups(mesh, rank, [(0, 1)] if mesh.size("pp") > 1 else [])
    after_first = threads()
    for _ in range(2):
        again = build_groups(mesh, rank, [(0, 1)] if mesh.size("pp") > 1 else [])
    same = all(again.by_axes[a] is g for a, g in first.by_axes.items()) and again.ties == first.ties
    return after_first, threads(), same, sorted(first.by_axes)
