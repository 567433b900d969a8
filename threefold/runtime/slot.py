"""What one (chunk, microbatch) keeps between its forward and its backward, and the hand-offs
between them: a chunk's outputs becoming the next local chunk's inputs, its input gradients
becoming the previous chunk's output gradients, and freeing sent outputs backward never reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Slot:
    """What one (chunk, microbatch) keeps between its forward and its backward."""
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    output_grads: list[torch.Tensor] = field(default_factory=list)


def handed_over(outs: list[torch.Tensor], train: bool) -> list[torch.Tensor]:
    """A chunk's outputs as the next chunk's inputs on the same rank, as a receive gives
    them: autograd leaves, so each chunk's backward stops at its own inputs."""
    inputs = [o.detach() for o in outs]
    for t in inputs:
        if train and t.is_floating_point():
            t.requires_grad_(True)
    return inputs


def input_grads(slot: Slot) -> list[torch.Tensor]:
    """The gradients of a chunk's floating inputs (zeros where autograd gave none)."""
    return [g if g is not None else torch.zeros_like(x)
            for x, g in zip(slot.inputs, slot.input_grads) if x.is_floating_point()]


def release_outputs(outputs: list[torch.Tensor], releasable: list[bool]) -> None:
    """Free the storage of sent outputs that backward does not read (Megatron does the same).

    Only outputs no op of the chunk reads (the manifest's `releasable`), that are not views,
    and whose grad_fn did not save the result itself (softmax, tanh, ...) are freed.
    """
    for o, ok in zip(outputs, releasable):
        fn = o.grad_fn
        if not ok or fn is None or o._base is not None or hasattr(fn, "_saved_result"):
            continue
        o.data = torch.empty((0,), dtype=o.dtype, device=o.device)
