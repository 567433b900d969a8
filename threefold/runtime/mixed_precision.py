"""Mixed precision (plan dtype=bf16|fp16): compute in 16 bits, keep fp32 master weights.

The design is torch.autocast's, so the parallel run follows the same casting rules as a
single process under `torch.autocast(device, dtype)`:

* Parameters stay fp32: they are the master weights, the optimizer state is fp32 and so
  are the gradients (autocast's casts are differentiable, so d(loss)/d(fp32 weight) is an
  fp32 tensor); the dp reduction therefore runs in fp32 (see docs/design.md for why).
* Each chunk's forward runs under torch.autocast (a dispatch key: it applies to the aten
  ops the generated code calls). Matmul-like ops compute in 16 bits; losses (cross_entropy,
  nll_loss, mse_loss) stay fp32 by autocast's own lists; threefold's vocab-parallel
  cross-entropy upcasts its logits shard first (runtime/tp_ops.py), so its row max, sum of
  exponentials and log-sum-exp are fp32. Recomputed segments rerun under the autocast
  state of their forward (torch.utils.checkpoint restores it).
* Floating tensors crossing a pipeline boundary travel in the dtype the manifest declares
  (the traced fp32), whatever autocast made of them: at a layer boundary that is the fp32
  residual stream, exactly as in the single process (`wire_dtype` says why not bf16).
* fp16 adds dynamic loss scaling (`LossScaler`): the backward seed is multiplied by the
  scale, the optimizer wrapper unscales, and a step whose gradients hold inf/nan on any
  rank is skipped on every rank and halves the scale; `growth_interval` good steps double it.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from threefold.runtime.run_plan import RunPlan

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def plan_of(manifest):
    """The plan of a manifest (a runtime.manifest.Manifest, or its JSON dict): a RunPlan."""
    plan = getattr(manifest, "plan", None)
    if plan is not None:
        return RunPlan.of(plan)
    return RunPlan.from_json(manifest.get("plan_values"), manifest.get("plan"))


def plan_dtype(manifest) -> str:
    """The plan's dtype key ('fp32' for artifacts built before the key existed)."""
    return plan_of(manifest).dtype


def compute_dtype(manifest) -> torch.dtype | None:
    return COMPUTE_DTYPES[plan_dtype(manifest)]


def wire_dtype(manifest) -> torch.dtype | None:
    """The dtype floating boundary tensors are sent in: None, as the manifest declares them.

    Measured (docs/design.md): under autocast a layer boundary is the residual stream,
    which is fp32 in the single process too (fp32 + bf16 promotes), so sending it in bf16
    would add a rounding the single process never does (loss deviation 2.7 sigma of the
    bf16 rounding noise vs 0.9 sigma, and no longer bitwise equal at step 0) to save
    half of the point-to-point bytes; we keep it exact. Boundary's `wire` still takes a
    dtype, for a plan that wants the saving."""
    return None


def install_autocast(modules: dict, dtype: torch.dtype | None, device: torch.device) -> None:
    """Run every chunk module's forward under torch.autocast(device.type, dtype).

    The wrapper sits on the instance's `forward`, so `module(*args)` (nn.Module.__call__)
    goes through it and the generated class stays a plain ChunkModule."""
    if dtype is None:
        return
    for mod in modules.values():
        if getattr(mod.forward, "_threefold_autocast", None) is not None:
            continue
        mod.forward = _autocast_forward(mod.forward, device.type, dtype)


def _autocast_forward(forward, device_type: str, dtype: torch.dtype):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)
    run._threefold_autocast = dtype
    return run


class CastCache:
    """One 16-bit copy of each weight per step, shared by every microbatch.

    autocast caches the bf16 copy of each fp32 weight it casts, but clears that cache when
    the outermost autocast region exits: with one region per chunk forward, every
    microbatch makes its own copies, and autograd keeps each microbatch's until its
    backward, so a stage holds 2 bytes per parameter per microbatch in flight (p of them on
    1F1B's first stage). `hold()` at the start of a step raises autocast's nesting count
    (without enabling autocast, so backward still runs outside it), which keeps the cache
    alive across the step's forwards: one copy, shared; `release()` at the end of the step
    clears it, before the optimizer changes the weights. The values are the same casts, so
    results are bitwise unchanged."""

    def __init__(self, dtype: torch.dtype | None):
        self.enabled = dtype is not None
        self.held = False

    def hold(self) -> None:
        if not self.enabled:
            return
        self.release()   # a step that raised never released: never reuse its copies
        torch.autocast_increment_nesting()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()


class LossScaler:
    """Dynamic loss scaling for fp16 (the scheme of torch.amp.GradScaler and Megatron).

    `scale` multiplies the backward seed; `unscale_and_check(grads)` divides the gradients
    by it and returns True when they are finite on every rank (one all-reduce of a flag
    over the whole job, so tp and pp ranks, which hold different parameters, agree).
    `update(finite)`: a bad step halves the scale (not below `min_scale`), `growth_interval`
    good steps in a row double it."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.skipped = 0            # steps skipped so far
        self.last_skipped = False

    def unscale_and_check(self, grads: list[torch.Tensor], device: torch.device) -> bool:
        inv = 1.0 / self.scale
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            g.mul_(inv)
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().to(bad.dtype))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from threefold.runtime import comm   # lazy: start-up: runtime.comm loads only on this path
            comm.all_reduce(bad, None, "the fp16 inf/nan flag", op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def update(self, finite: bool) -> None:
        self.last_skipped = not finite
        if not finite:
            self.skipped += 1
            self.good_steps = 0
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.good_steps = 0
            if math.isfinite(self.scale * self.growth_factor):
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state.get("good_steps", 0))
        self.skipped = int(state.get("skipped", 0))
