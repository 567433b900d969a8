"""A loss computed eagerly by the last chunk: the user's loss_fn, called as Python.

When torch.export cannot trace a loss (CTC: aten._ctc_loss's output shape depends on the
data) or the plan says `loss=eager`, the compiler traces the model alone and ends the graph
with one call of `call_loss` on the model's outputs and the target (compiler/eager_loss.py).
Generated code calls it like any op; autograd runs through it, so its backward is the
loss's own. The loss function itself is code, not data: a manifest names it by key
(`module:qualname`), and each process that runs the artifact registers the function
(`register`; threefold.parallelize does this with its loss_fn).
"""
from __future__ import annotations

import json

import torch

from threefold.errors import PlanError
from threefold.runtime.output_tree import rebuild

_LOSSES: dict[str, object] = {}


def key_of(fn) -> str:
    """The name a loss function is registered under: `module:qualname`."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def register(fn, key: str | None = None) -> str:
    key = key or key_of(fn)
    _LOSSES[key] = fn
    return key


def call_loss(key: str, tree: str, scale: float, target, *outputs):
    """loss_fn(model output rebuilt from `outputs` and `tree`, target) * scale: the last
    chunk's loss (scale turns a per-microbatch mean into its numerator, loss_form.py)."""
    fn = _LOSSES.get(key)
    if fn is None:
        raise PlanError(f"this artifact computes its loss eagerly with {key}, which is not registered in "
                        f"this process: call threefold.runtime.eager_loss.register(loss_fn) before running it")
    loss = fn(rebuild(json.loads(tree), tuple(outputs)), target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise PlanError(f"loss_fn {key} must return one scalar tensor")
    loss = loss.reshape(())
    return loss * scale if scale != 1 else loss
