"""Running a user's model for the compiler's own purposes without changing it.

The compiler runs forward to trace it (torch.export) and to probe it (which input dim is the
batch): forward may write buffers (a step counter) or register new ones (a cached causal
mask), and the user's module must come out as it went in.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def buffer_tables_kept(model: torch.nn.Module):
    """Every module's buffer table as it was before the block: buffers that forward
    registered or replaced are dropped (export restores plain attributes, not `_buffers`
    entries, and would leave its fake tensors in the user's module)."""
    saved = [(m, dict(m._buffers)) for m in model.modules()]
    try:
        yield
    finally:
        for module, buffers in saved:
            module._buffers.clear()
            module._buffers.update(buffers)


@contextlib.contextmanager
def probing(model: torch.nn.Module):
    """Run the model in eval mode without gradients; yields `restore()`, which puts every
    buffer table and every buffer's value back (call it between runs so each starts from the
    user's state). On exit the same, and the model's training mode as it was."""
    was_training = model.training
    tables = [(m, dict(m._buffers)) for m in model.modules()]
    values = {k: b.detach().clone() for k, b in model.named_buffers()}

    def restore():
        for module, table in tables:
            module._buffers.clear()
            module._buffers.update(table)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(values[k])
    model.eval()
    try:
        with torch.no_grad():
            yield restore
    finally:
        restore()
        model.train(was_training)
