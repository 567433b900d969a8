"""Rank functions for tests/test_cp_scans.py (launched on gloo ranks)."""
from __future__ import annotations

import torch


def scan_against_torch(kinds: list, cp: int) -> dict:
    """Each scan over dim 1 of a [3, 8*cp, 5] tensor, this rank holding blocks r and 2cp-1-r:
    the largest difference of its values and of the input's gradient from torch on the whole."""
    import torch.distributed as dist
    from threefold.runtime.cp_ops import block_positions, local_blocks
    from threefold.runtime.cp_scan import scan_seq
    torch.set_num_threads(1)
    r = dist.get_rank()
    out = {}
    for kind in kinds:
        g = torch.Generator().manual_seed(7)
        whole = (torch.rand(3, 8 * cp, 5, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
        weight = torch.randn(3, 8 * cp, 5, generator=g, dtype=torch.float64)
        (getattr(torch, kind)(whole, 1) * weight).sum().backward()
        mine = local_blocks(whole.detach(), 1, cp, r).clone().requires_grad_()
        y = scan_seq(mine, 1, kind, dist.group.WORLD, ranks=cp)
        (y * local_blocks(weight, 1, cp, r)).sum().backward()
        ref_y = getattr(torch, kind)(whole.detach(), 1)
        pos = block_positions(8, cp, r)
        out[kind] = (float((y.detach() - ref_y.index_select(1, pos)).abs().max()),
                     float((mine.grad - whole.grad.index_select(1, pos)).abs().max()))
    return out
