"""Text from a trained language model: the full weights in one process, then sampling.

A parallel model's weights live in shards over tp and pipeline stages; generation is a
single-process job, so the weights are first made whole: `gather_full_state` (a collective
at the end of a run: each dp-rank-0 rank's pieces go to rank 0) or checkpoint.export's
`consolidate` (from a checkpoint on disk). `sample` then extends a prompt one token at a time,
greedily (temperature 0) or by sampling from softmax(logits / temperature) with a seeded
generator (optionally only the top k), keeping at most `context` tokens as the model's input.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.errors import PlanError


def gather_full_state(pm) -> dict[str, torch.Tensor] | None:
    """Full tensors of every parameter and buffer by canonical FQN on rank 0 (None elsewhere)."""
    # lazy: start-up: checkpoint.state loads only on this path
    from threefold.checkpoint.state import full_shapes, holds_unique, model_state
    mine = []
    for fqn, s in model_state(pm).items():
        if holds_unique(pm, s):
            mine.append((fqn, [(list(offs), list(sizes), view.detach().cpu().clone())
                               for offs, sizes, view in s.regions()]))
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() != 0:
            return None
    shapes = full_shapes(pm.manifest)
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        for fqn, pieces in part:
            shape, dtype = shapes[fqn]
            t = full.setdefault(fqn, torch.zeros(shape, dtype=getattr(torch, dtype)))
            for offs, sizes, value in pieces:
                dest = t
                for d, (o, n) in enumerate(zip(offs, sizes)):
                    dest = dest.narrow(d, o, n)
                dest.copy_(value.reshape(dest.shape))
    return full


def load_into(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into an eager model by FQN. Tied parameters are one Parameter under
    their first name (which is the name threefold keys them by); a buffer the state lacks
    (one the model rebuilds itself) keeps the model's value; a missing parameter is an error."""
    params = dict(model.named_parameters())
    missing = [k for k in params if k not in full]
    if missing:
        raise PlanError(f"the weights have no tensor for {', '.join(missing[:3])}: they are of another model")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(full[name].to(p.dtype))
        for name, b in model.named_buffers():
            if name in full and tuple(full[name].shape) == tuple(b.shape):
                b.copy_(full[name].to(b.dtype))


def _logits(out) -> torch.Tensor:
    """The logits a model returned: a tensor, the first of a tuple, or `.logits` (HF)."""
    if hasattr(out, "logits"):
        out = out.logits
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise PlanError("this model's output is not (batch, sequence, vocabulary) logits: it is not a "
                        "language model threefold can sample from")
    return out


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], new_tokens: int, context: int,
           temperature: float = 1.0, top_k: int | None = None, seed: int = 0) -> list[int]:
    """`prompt` extended by `new_tokens` ids (the prompt included in the result)."""
    if not prompt:
        raise PlanError("the prompt is empty after tokenizing: give at least one character")
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    try:
        for _ in range(new_tokens):
            x = torch.tensor([ids[-context:]], dtype=torch.long, device=device)
            logits = _logits(model(x))[0, -1].float().cpu()
            if temperature <= 0:
                ids.append(int(logits.argmax()))
                continue
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    finally:
        model.train(was_training)
    return ids
