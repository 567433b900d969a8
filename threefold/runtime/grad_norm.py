"""The global gradient norm of a parallel model, and clipping by it.

The norm is the one a single process would compute over the model's parameters: every
element of every trainable parameter's gradient counted exactly once. Each rank adds the
squares of the gradient elements it is the one owner of, and one all-reduce over the world
sums them:

  * data parallel: after the step's all-reduce every dp replica holds the same averaged
    gradients, so only dp rank 0 contributes; under ZeRO-1 (plan zero=1) the gradients are
    reduce-scattered instead and each dp rank holds only its own rows (the others zeroed,
    runtime/zero.py), so every dp rank contributes its rows;
  * tensor parallel: a sharded parameter (the manifest's `shards`) contributes each tp
    rank's own pieces (checkpoint/layout.py `pieces`: fused q/k/v blocks, and never the
    padding rows of a vocabulary tp does not divide); a replicated one (layer norms,
    biases after a row-parallel matmul, sequence-parallel norms whose partial gradients
    the engine summed over tp) only tp rank 0's copy;
  * pipeline parallel: each stage holds different parameters, except tied ones (an input
    embedding reused as the LM head): after the engine summed them, every holder stage has
    the same gradient, and only the stage of its first holder chunk contributes.
Squares are summed in float64 so the norm does not depend on how the terms are split.
Under fp16 the gradients are still multiplied by the loss scale when the loop clips (the
loss-scaled optimizer unscales them in its step): the norm reported is of the unscaled
gradients, and scaling by the clip coefficient commutes with the later unscaling.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from threefold.runtime import comm
from threefold.runtime.shard import ShardSpec


def owned_grad_pieces(engine) -> list[torch.Tensor]:
    """The gradient pieces this rank contributes to the global norm (views, no copies)."""
    from threefold.checkpoint.layout import pieces   # layout math only (no checkpoint I/O)
    coord, manifest = engine.coord, engine.manifest
    if coord.dp != 0 and _plan(engine).zero != 1:
        return []
    first_holder = _first_holder_stage(manifest["chunks"])
    shards = manifest.get("shards", {})
    shapes = manifest.get("state_shapes", {})
    out = []
    for fqn, p in engine.params.items():
        if not p.requires_grad or p.grad is None:
            continue
        if fqn in first_holder and engine.stage != first_holder[fqn]:
            continue
        g = p.grad
        if fqn not in shards:
            if coord.tp == 0:
                out.append(g)
            continue
        spec = ShardSpec.from_json(shards[fqn])
        full_shape = shapes[fqn][0] if fqn in shapes else _unpadded_shape(g, spec)
        dim, parts = pieces(spec, full_shape, coord.tp)
        out.extend(g.narrow(dim, piece.local, piece.length) for piece in parts)
    return out


def _first_holder_stage(chunks) -> dict[str, int]:
    """Tied FQN -> the stage of the first chunk holding it (the manifest's recorded stage,
    so any chunk layout works): the one stage that counts it."""
    stage = {c["index"]: c["stage"] for c in chunks}
    out = {}
    for c in chunks:
        for fqn, holders in (c.get("shared_params") or {}).items():
            out[fqn] = stage[min(holders)]
    return out


def _plan(engine):
    from threefold.runtime.mixed_precision import plan_of
    return plan_of(engine.manifest)


def _unpadded_shape(local: torch.Tensor, spec: ShardSpec) -> list[int]:
    """A full shape for a manifest without state_shapes: the padded size (no padding known)."""
    shape = list(local.shape)
    shape[spec.dim] = spec.padded if not spec.blocks else sum(spec.blocks)
    return shape


def global_grad_norm(engine) -> float:
    """The 2-norm of all trainable gradients of the whole model, the same on every rank."""
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    for g in owned_grad_pieces(engine):
        total += g.detach().double().pow(2).sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(total, None, "the gradient norm")
    return math.sqrt(float(total)) / float(getattr(engine, "loss_scale", 1.0) or 1.0)


def clip_grad_norm_(engine, max_norm: float, eps: float = 1e-6) -> float:
    """Scale every local gradient by min(1, max_norm / (norm + eps)) (torch's rule, with the
    global norm); returns the norm before clipping. A non-finite norm scales nothing: the
    caller decides what a non-finite step means (threefold train stops or skips it)."""
    norm = global_grad_norm(engine)
    coef = max_norm / (norm + eps)
    if math.isfinite(norm) and coef < 1.0:
        with torch.no_grad():
            for p in engine.params.values():
                if p.requires_grad and p.grad is not None:
                    p.grad.mul_(coef)
    return norm
