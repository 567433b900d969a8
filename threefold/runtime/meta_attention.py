"""Attention on meta tensors as a real device runs it: the fused kernel, no score tensor.

`scaled_dot_product_attention` picks its kernel from the tensors' device
(`torch._fused_sdp_choice`). A meta tensor has no device kernel, so the pick is the math
fallback, which materialises the [B, H, L, S] scores and keeps them (and the softmax) for
backward: a dry run on meta then counts O(s^2) bytes per layer that no real run holds
(a real CPU or GPU run takes flash attention, which keeps the output and a [B, H, L]
log-sum-exp). That was the dry run's disagreement with the memory model
(planner/saved_bytes.py runs each op on CPU fakes, so it sees the fused kernel) at long
sequences: +76% on a Llama-405B-shaped job, +134% on a DeepSeek-V3-shaped one.

`sdpa_on_meta(...)` asks torch's own choice for CPU tensors of the same shapes, strides
and dtypes (fake tensors: nothing is allocated) and, where it is flash attention, calls
the fused op on the meta tensors (its meta kernel gives the outputs, its autograd formula
what is saved); elsewhere (dropout on CPU, a mask that needs a gradient) the math path, as
the real run takes it. Choices are cached by the call's metadata: a job asks the same
question once per distinct layer shape.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
SDPA_FUNCS = (aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)


def _meta(t) -> tuple | None:
    if not isinstance(t, torch.Tensor):
        return None
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)


@functools.lru_cache(maxsize=256)
def _cpu_takes_flash(q, k, v, mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool) -> bool:
    """Whether torch's SDPA on CPU tensors of this metadata runs the flash kernel: the op
    itself runs on CPU fakes (FakeTensorMode: nothing allocated, the CPU kernel's choice;
    `torch._fused_sdp_choice` called alone answers for meta there) and the kernel it
    dispatches is watched."""

    class Watch(TorchDispatchMode):
        flash = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
                Watch.flash = True
            return func(*args, **(kwargs or {}))

    def fake(m):
        if m is None:
            return None
        shape, stride, dtype, grad = m
        t = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
        return t.requires_grad_(True) if grad and dtype.is_floating_point else t
    with _disable_current_modes(), FakeTensorMode():    # the step's meter must not count the stand-ins
        args = (fake(q), fake(k), fake(v), fake(mask))
        with torch.enable_grad(), Watch():
            aten.scaled_dot_product_attention.default(*args, dropout_p, is_causal, scale=scale,
                                                      enable_gqa=enable_gqa)
    return Watch.flash


def sdpa_on_meta(func, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    """`func` (torch's SDPA) on meta tensors, with the kernel a CPU run would take."""
    if not _cpu_takes_flash(_meta(query), _meta(key), _meta(value), _meta(attn_mask), float(dropout_p),
                            bool(is_causal), scale, bool(enable_gqa)):
        return func(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:   # as torch does: an additive mask
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    out, _ = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, float(dropout_p), bool(is_causal),
                                                              attn_mask=attn_mask, scale=scale)
    return out
