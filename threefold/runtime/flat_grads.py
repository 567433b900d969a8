"""A flat gradient bucket back into the gradients it was concatenated from (the
data-parallel reduction's last step, gloo or shared memory alike)."""
from __future__ import annotations

import torch


def unflatten_into(flat: torch.Tensor, grads: list[torch.Tensor], scale: float) -> None:
    """grads[i] = flat's piece i * scale. `flat` is the engine's own (a fresh concatenation or
    the exchange's sum buffer), so it is scaled in place: one multiply and one foreach copy
    instead of two ops per tensor (0.27 vs 0.67 ms for the embedded GPT's 52)."""
    if all(g.dtype == flat.dtype and g.device == flat.device for g in grads):
        if scale != 1.0:
            flat.mul_(scale)
        torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))
        return
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g)).mul_(scale)
        offset += n
