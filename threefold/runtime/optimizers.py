"""`pm.optimizer(torch.optim.AdamW, lr=...)`: the optimizer a plan needs, around any torch one.

* zero=0, fp32/bf16: the torch optimizer itself, over pm.parameters() (so building it by
  hand, `torch.optim.AdamW(pm.parameters())`, is the same thing);
* zero>=1: a `zero.ZeroOptimizer` (its state and update sharded over dp_shard; zero>=2 reads
  the gradient row shards runtime/fsdp.py reduces, zero=3 updates the parameter shards);
* fp16: either of those inside a `LossScaledOptimizer` (dynamic loss scaling);
* compile=inductor: the torch optimizer built with fused=True where it offers it
  (runtime/fused_optimizer.py: the optimizer step's part of the compiled backend).
ZeRO and fp16 change how gradients arrive (reduce-scattered rows, scaled values), so a
plain optimizer would silently be wrong under them: the engine refuses to train until one
built here is attached (`requirement`).
"""
from __future__ import annotations

import torch

from threefold.errors import PlanError
from threefold.runtime import fused_optimizer
from threefold.runtime.mixed_precision import LossScaler, plan_of
from threefold.runtime.wrapped_optimizer import WrappedOptimizer


def _plan(engine):
    return plan_of(engine.manifest)


def requirement(manifest) -> str | None:
    """Why this plan needs pm.optimizer(...) (None if any torch optimizer will do)."""
    plan = plan_of(manifest)
    why = [k for k, on in ((f"zero={plan.zero}", plan.zero >= 1), ("dtype=fp16", plan.dtype == "fp16")) if on]
    if not why:
        return None
    return (f"plan {' and '.join(why)} needs the optimizer built by the ParallelModule: "
            "opt = pm.optimizer(torch.optim.AdamW, lr=...) instead of torch.optim.AdamW(pm.parameters(), ...)")


def make_optimizer(engine, optimizer_cls, params=None, *args, loss_scaler: LossScaler | None = None,
                   prefer_fused: bool = False, **kwargs):
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise PlanError(f"pm.optimizer needs a torch.optim.Optimizer class (got {optimizer_cls!r}): "
                        "e.g. pm.optimizer(torch.optim.AdamW, lr=1e-3)")
    plan = _plan(engine)
    if params is not None:
        params = list(params)   # a generator would be empty if a refused fused build retries
    if plan.zero >= 1:
        # lazy: start-up: runtime.zero loads only on this path
        from threefold.runtime.zero import ZeroOptimizer

        def make(**kw):
            return ZeroOptimizer(engine, optimizer_cls, params, *args, **kw)
    else:
        params = list(engine.parameters()) if params is None else params

        def make(**kw):
            return optimizer_cls(params, *args, **kw)
    opt = fused_optimizer.build(make, optimizer_cls, kwargs, plan.compile, prefer=prefer_fused)
    if plan.dtype == "fp16":
        opt = LossScaledOptimizer(engine, opt, loss_scaler or LossScaler())
    elif loss_scaler is not None:
        raise PlanError(f"loss_scaler= is for plan dtype=fp16 (this plan is dtype={plan.dtype}); drop it")
    engine.use_optimizer(opt)
    return opt


class LossScaledOptimizer(WrappedOptimizer):
    """fp16: unscale the gradients, skip the step on every rank if any rank saw inf/nan,
    and update the scale the engine seeds the next backward with."""

    def __init__(self, engine, inner, scaler: LossScaler):
        self.engine, self.inner, self.scaler = engine, inner, scaler
        engine.set_loss_scale(scaler.scale)

    def grads(self) -> list[torch.Tensor]:
        if hasattr(self.inner, "grads"):
            return self.inner.grads()
        return [p.grad for g in self.inner.param_groups for p in g["params"] if p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    @property
    def last_step_skipped(self) -> bool:
        return self.scaler.last_skipped

    def step(self, closure=None) -> bool:
        """Returns True when the update was applied (False: skipped for inf/nan)."""
        finite = self.scaler.unscale_and_check(self.grads(), self.engine.device)
        if finite:
            self.inner.step()
        self.scaler.update(finite)
        self.engine.set_loss_scale(self.scaler.scale)
        return finite

    def state_dict(self):
        return {"optimizer": self.inner.state_dict(), "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, sd) -> None:
        self.inner.load_state_dict(sd["optimizer"])
        self.scaler.load_state_dict(sd["loss_scaler"])
