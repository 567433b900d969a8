"""A non-finite loss at the first step: which op produced the first nan/inf.

The first step's loss is computed from the model's initial weights, so the single-process
model on the same batch reproduces it. We run it once (no gradients) under a dispatch mode
that looks at every ATen op's floating outputs and stops at the first one holding a nan or
an inf, naming the op and the module it ran in. Only called once a step has already gone
non-finite, so the extra forward costs nothing in a healthy run.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from threefold.model_loss import model_loss


class _Found(Exception):
    pass


class _FirstNonFinite(TorchDispatchMode):
    def __init__(self, where: list):
        super().__init__()
        self.where = where        # the module stack, innermost last
        self.found: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not t.is_meta \
                    and not bool(torch.isfinite(t).all()):
                finite_in = all(bool(torch.isfinite(a).all()) for a in torch.utils._pytree.tree_leaves((args, kwargs))
                                if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()
                                and not a.is_meta)
                what = "from finite inputs" if finite_in else "passing on a non-finite input"
                module = self.where[-1] if self.where else "<top>"
                self.found = f"{func} in module {module!r} ({what})"
                raise _Found
        return out


def first_nonfinite_op(model: torch.nn.Module, inputs: tuple, target=None, loss_fn=None) -> str | None:
    """'aten.op in module 'path' (...)' for the first op of `model`'s forward (and its loss)
    whose output is not finite; None when the single-process loss is finite, '' when the
    model cannot be run here (meta weights, an error)."""
    if any(p.is_meta for p in model.parameters()):
        return ""
    names = {m: n or "<top>" for n, m in model.named_modules()}
    stack: list[str] = []
    def enter(module, args):
        stack.append(names[module])

    def leave(module, args, out):   # (a hook returning a value would replace the output)
        if stack:
            stack.pop()
    hooks = [m.register_forward_pre_hook(enter) for m in names]
    hooks += [m.register_forward_hook(leave) for m in names]
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    mode = _FirstNonFinite(stack)
    try:
        with torch.no_grad(), mode:
            out = model(*inputs)
            stack.clear()
            stack.append("<loss_fn>" if loss_fn is not None else "<top>")
            loss = loss_fn(out, target) if loss_fn is not None else model_loss(out)
        if loss is not None and not bool(torch.isfinite(loss).all()):
            return "the loss itself"
        return None
    except _Found:
        return mode.found
    except Exception:   # the diagnosis must never hide the error it explains
        return ""
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])


def nonfinite_message(loss: float, name: str, found: str | None) -> str:
    """The one line for a non-finite loss at the first step."""
    head = f"the loss is {loss} at the first step"
    if found is None:
        return (f"{head}, but {name} run in one process on the same batch gives a finite loss: "
                "the parallel run differs from the model (please report it with the plan)")
    if not found:
        return (f"{head} ({name}); check the inputs and the initial weights "
                "(run the model once in one process to see where it goes non-finite)")
    return (f"{head}: {name}'s first non-finite value comes from {found}; fix the input "
            "or the initialisation there (the single-process model gives the same)")
