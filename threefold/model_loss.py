"""The loss a model returns itself, for training without a `loss_fn`.

Hugging Face models given `labels=` return an output whose `.loss` is the loss; many
hand-written models return the scalar loss, or a `(logits, loss)` / `(loss, logits)` tuple.
One rule finds it, for the compiler's trace and for the single-process references alike:

  1. an output with a `loss` entry (a ModelOutput, a dict) that is a tensor: that entry;
  2. a tensor with one element: the output itself;
  3. a tuple or list: its single one-element floating leaf (a tensor of a (logits, loss)
     tuple); with several (a loss and an auxiliary loss), the first leaf when it is one
     (Hugging Face's return_dict=False order puts the loss first), else ambiguous.

`None` means the model returns no loss; `AmbiguousLoss` that it returns several candidates
and the user must say which with a loss_fn.
"""
from __future__ import annotations

import torch

from threefold.errors import PlanError


class AmbiguousLoss(PlanError):
    pass


def _is_scalar(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1


def _leaves(value) -> list:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def model_loss(out, name: str = "the model"):
    """The loss tensor in `out` (a model's return value) by the rule above, or None."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None) \
        if not isinstance(out, (torch.Tensor, tuple, list)) else None
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out if _is_scalar(out) else None
    if not isinstance(out, (tuple, list)):
        return None
    leaves = _leaves(out)
    scalars = [v for v in leaves if _is_scalar(v)]
    if len(scalars) == 1:
        return scalars[0]
    if len(scalars) > 1:
        if leaves and leaves[0] is scalars[0]:
            return scalars[0]
        raise AmbiguousLoss(f"{name} returns {len(scalars)} scalar tensors and none first, so its loss is "
                            "ambiguous; pass loss_fn=lambda out, target: out[i] (and a target) to parallelize")
    return None


def no_loss_message(name: str) -> str:
    """The one line for a model with neither a loss output nor a loss_fn."""
    return (f"{name} returns no loss and no loss_fn was given, so there is nothing to train on: "
            "pass loss_fn=... and target=... to parallelize, or return the loss from forward "
            "(a scalar, an output with .loss such as a Hugging Face model given labels=, or (logits, loss)); "
            "pm(x) runs inference")


def workload_loss(model, inputs: tuple, target=None, loss_fn=None):
    """The single-process loss of one batch: loss_fn(model(*inputs), target), or the loss the
    model returns itself (None when it returns none)."""
    out = model(*inputs)
    return loss_fn(out, target) if loss_fn is not None else model_loss(out, type(model).__name__)


def check_trainable(w, what: str) -> None:
    """A PlanError unless workload `w` can train: a loss_fn with a target, or (no loss_fn) a
    model that returns its own loss on the example inputs (checked where weights are real)."""
    if w.loss_fn is not None:
        if w.target is None:
            raise PlanError(f"{what} has a loss_fn but no target; give the workload's 'target' too")
        return
    if any(p.is_meta for p in w.model.parameters()):
        return   # cannot run it here: parallelize finds the loss in the graph (or says there is none)
    was_training = w.model.training
    buffers = {k: b.detach().clone() for k, b in w.model.named_buffers()}
    try:
        with torch.no_grad():
            loss = model_loss(w.model(*w.inputs), type(w.model).__name__)
    finally:
        with torch.no_grad():
            for k, b in w.model.named_buffers():
                b.copy_(buffers[k])
        w.model.train(was_training)
    if loss is None:
        raise PlanError(f"{what}: {no_loss_message(type(w.model).__name__)}")
