"""The global gradient norm of a parallel model, and clipping by it.

The norm is the one a single process would compute over the model's parameters: every
element of every trainable parameter's gradient counted exactly once. Each rank adds the
squares of the gradient elements it is the one owner of, and one all-reduce over the world
sums them (without ZeRO and ep every batch rank, dp x cp, holds the same reduced gradients:
each rank then counts as the batch rank 0 of its pipeline stage and tensor-parallel rank
would, and the sum runs over pp x tp only, or not at all for plain data parallelism, so the
clip is no extra synchronisation of the batch ranks):

  * data parallel: after the step's all-reduce every dp replica holds the same averaged
    gradients, so only dp rank 0 contributes; under ZeRO (plan zero>=1) the gradients are
    reduce-scattered instead and each dp_shard rank holds only its own rows (zero=1: the
    others zeroed, runtime/zero.py; zero>=2: a row shard, runtime/fsdp.py), so every dp_shard
    rank of replica 0 contributes its rows;
  * tensor parallel: a sharded parameter (the manifest's `shards`) contributes each tp
    rank's own pieces (checkpoint/layout.py `pieces`: fused q/k/v blocks, and never the
    padding rows of a vocabulary tp does not divide); a replicated one (layer norms,
    biases after a row-parallel matmul, sequence-parallel norms whose partial gradients
    the engine summed over tp) only tp rank 0's copy;
  * expert parallel (ep): each ep rank holds different experts, equal over the edp ranks,
    so edp rank 0 of each ep rank counts its experts (dense parameters as above);
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
from threefold.runtime.shard import ShardSpec, pieces


def _replicated_over_batch(engine) -> bool:
    """Every batch rank (dp x cp) holds the same gradients after the step's reduction."""
    return _plan(engine).zero == 0 and engine.mesh.ep == 1


def owned_grad_pieces(engine, as_batch_rank_0: bool = False) -> list[torch.Tensor]:
    """The gradient pieces this rank contributes to the global norm (views, no copies);
    `as_batch_rank_0`: the pieces its dp=0, cp=0 replica contributes (equal gradients).

    Without ZeRO which pieces count is fixed for the engine's life (its parameters, plan and
    coordinates): worked out once, then each call only cuts this step's gradients (the walk
    over the manifest cost as much as the norm itself, 0.1-0.4 ms a step)."""
    zero = _plan(engine).zero
    if zero == 0:
        cache = engine.memo.setdefault("owned_cuts", {})
        if as_batch_rank_0 not in cache:
            cache[as_batch_rank_0] = _owned_cuts(engine, as_batch_rank_0, zero)
        cuts = cache[as_batch_rank_0]
    else:
        cuts = _owned_cuts(engine, as_batch_rank_0, zero)
    out = []
    for p, g, cut in cuts:
        g = p.grad if g is None else g   # zero=0: this step's gradient
        if g is None:
            continue
        out.append(g if cut is None else g.narrow(*cut))
    return out


def _owned_cuts(engine, as_batch_rank_0: bool, zero: int) -> list[tuple]:
    """[(parameter, its gradient part or None for p.grad itself at zero=0, None: whole |
    (dim, start, length): a narrow of it)] this rank counts in the norm."""
    from threefold.runtime.zero import row_range   # lazy: start-up: runtime.zero loads only on this path
    coord, manifest = engine.coord, engine.manifest
    if as_batch_rank_0:
        coord = engine.mesh.coord(engine.mesh.moved(engine.groups.rank, dp_replicate=0, dp_shard=0, cp=0))
    # zero=0: dp replicas hold equal gradients (dp rank 0 counts them); zero>=1: each
    # dp_shard rank owns its rows, and the replicas of a shard group (HSDP) are equal
    # ep: an expert's gradient is equal over the ranks holding it (edp) and each ep rank holds
    # different experts, so edp rank 0 of every ep rank counts its experts
    experts = manifest.expert_weights()   # placed ep S(0), or whole on their ep rank
    if zero == 0:
        counts_dense, counts_experts = coord["dp"] == 0, coord["edp"] == 0
    else:   # zero=1 with ep: dp_shard ranks own rows; dense rows are equal over ep ranks too
        counts_experts = coord["dp_replicate"] == 0
        counts_dense = counts_experts and (not experts or coord["ep"] == 0)
    if coord["cp"] != 0:   # cp ranks hold the same parameters and, reduced, the same gradients
        return []
    if not counts_dense and not (experts and counts_experts):
        return []
    d, r = engine.mesh.size("dp_shard"), coord["dp_shard"]
    first_holder = _first_holder_stage(manifest["chunks"])
    shards = manifest.get("shards", {})
    shapes = manifest.get("state_shapes", {})
    out = []
    for fqn, p in engine.params.items():
        if not p.requires_grad or (fqn in first_holder and engine.stage != first_holder[fqn]):
            continue
        if (fqn in experts and not counts_experts) or (fqn not in experts and not counts_dense):
            continue
        if zero == 0:   # the whole gradient, whichever tensor it is at call time
            g, start, count, scalar = None, 0, p.shape[0] if p.dim() else 1, p.dim() == 0
        else:
            g, start, count = _rows(engine, fqn, p, zero, d, r, row_range)
            if g is None:
                continue
            scalar = g.dim() == 0
        if fqn not in shards:
            if coord.tp == 0:
                out.append((p, g, None))
            continue
        spec = ShardSpec.from_json(shards[fqn])
        full_shape = shapes[fqn][0] if fqn in shapes else _unpadded_shape(p, spec)
        dim, parts = pieces(spec, full_shape, coord.tp, owned=True)
        for piece in parts:
            if dim != 0 or scalar:
                out.append((p, g, (dim, piece.local, piece.length) if not scalar else None))
                continue
            lo, hi = max(piece.local, start), min(piece.local + piece.length, start + count)
            if hi > lo:   # tp and ZeRO both split rows: their intersection
                out.append((p, g, (0, lo - start, hi - lo)))
    return out


def _rows(engine, fqn, p, zero: int, d: int, r: int, row_range):
    """(this rank's part of the gradient, its first row, its rows): the whole gradient at
    zero=0, its ZeRO rows otherwise (zero=1: rows of p.grad; zero>=2: the reduced row shard)."""
    rows = p.shape[0] if p.dim() else 1
    if zero == 0:
        return p.grad, 0, rows
    _, start, count = row_range(rows, d, r)
    if zero >= 2:
        g = engine.sharded.grad_rows(fqn)
    else:
        g = None if p.grad is None else (p.grad.narrow(0, start, count) if p.dim() else p.grad.view(1))
    if g is not None and p.dim() == 0:
        g = g.reshape(count)
    return g, start, count


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
    # lazy: start-up: runtime.mixed_precision loads only on this path
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
    replicated = _replicated_over_batch(engine)
    pieces = [g.detach() if g.requires_grad else g for g in owned_grad_pieces(engine, as_batch_rank_0=replicated)]
    if pieces:   # one foreach kernel (each piece's norm in float64), not a loop of small ops
        total += torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).pow(2).sum()
    if replicated:
        group = engine.groups.of("pp+tp")
        if group is not None:
            comm.all_reduce(total, group, "the gradient norm")
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(total, None, "the gradient norm")
    return math.sqrt(float(total)) / float(getattr(engine, "loss_scale", 1.0) or 1.0)


def clip_grad_norm_(engine, max_norm: float, eps: float = 1e-6) -> float:
    """Scale every local gradient by min(1, max_norm / (norm + eps)) (torch's rule, with the
    global norm); returns the norm before clipping. A non-finite norm scales nothing: the
    caller decides what a non-finite step means (threefold train stops or skips it)."""
    norm = global_grad_norm(engine)
    coef = max_norm / (norm + eps)
    if math.isfinite(norm) and coef < 1.0:
        grads = [p.grad for p in engine.params.values() if p.requires_grad and p.grad is not None]
        if engine.sharded is not None:   # zero>=2: the gradients are these row shards
            grads += list(engine.sharded.grads.values())
        with torch.no_grad():
            if grads:
                torch._foreach_mul_(grads, coef)
    return norm
