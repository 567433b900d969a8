"""Find each user input's batch dimension (model inputs, then the target).

Microbatches and dp ranks split the global batch along it, at trace time and in the
engine. The rule, in order:
  1. the workload declares `batch_dims` (an int for every tensor, or one entry per input,
     None for an input that is not split);
  2. candidates: a size B divisible by dp*m, and for each tensor input the dims of size B
     (a tensor without one is not split); a unique candidate at dim 0 is the answer, a
     unique one elsewhere must pass rule 3's check (with real weights), or it is refused;
  3. several candidates and real weights: a numeric check. The model runs (eval mode, no
     grad) on the full batch and on the last 1/(dp*m) slice along each candidate; the batch
     dim is the one whose slice gives a slice of the full output (the last slice, so a
     causal model split along its sequence does not pass: it would lack the prefix);
  4. still ambiguous: on the meta device, dim 0 when it is a candidate (with a note);
     otherwise a PlanError asking for batch_dims.
"""
from __future__ import annotations

import itertools

import torch

from threefold.errors import PlanError
from threefold.model_state import probing


def find_batch_dims(model: torch.nn.Module, batch: tuple, num_model_inputs: int, parts: int,
                    declared=None, name: str = "", notes: list | None = None, loss_fn=None) -> list:
    """One entry per batch entry: its batch dim, or None where it is not split."""
    tensors = [i for i, t in enumerate(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if declared is not None:
        return _declared(batch, declared, parts, name)
    if parts == 1 or not tensors:
        return [None] * len(batch)
    cands = _candidates(batch, tensors, parts)
    if not cands:
        shapes = ", ".join(str(tuple(batch[i].shape)) for i in tensors)
        raise PlanError(f"{name}: no dimension of the inputs ({shapes}) has a size divisible by "
                        f"dp*m={parts}; use a global batch that is a multiple of {parts}, or declare batch_dims")
    real = not any(p.is_meta for p in model.parameters()) and not any(
        batch[i].is_meta for i in tensors)
    if len(cands) == 1:
        only = cands[0]
        if all(d in (None, 0) for d in only) or not real:
            return only
        # the one divisible size is not at dim 0 (a [batch=2, seq=16] input at dp*m=4 offers
        # only its sequence): split there only if the model's rows are independent along it
        if _slice_matches(model, batch[:num_model_inputs], only, parts):
            return only
        shapes = ", ".join(str(tuple(batch[i].shape)) for i in tensors)
        raise PlanError(f"{name}: no batch dimension of the inputs ({shapes}) is divisible by dp*m={parts} "
                        f"(the only divisible dims, {only}, do not split the model's rows independently); "
                        f"use a global batch that is a multiple of {parts}, or declare batch_dims")
    if real:
        # Several can pass only when the model treats both dims as independent rows; the
        # full batch's output is computed once for all the candidates
        full: list = []
        passing = [c for c in cands if _slice_matches(model, batch[:num_model_inputs], c, parts, full)]
        if len(passing) > 1 and loss_fn is not None and num_model_inputs < len(batch):
            # the slice check reads the model inputs only; the target's dim is the one whose
            # parts meet the same rows at the loss (batch == seq: a [T, B] target of a
            # seq-first model must not be cut along T)
            paired = [c for c in passing if _loss_pairs(model, batch, num_model_inputs, c, parts, loss_fn)]
            passing = paired or passing
        if passing:
            return passing[0]      # then either split is exact: the first (lowest dims)
    zeros = [c for c in cands if all(d in (None, 0) for d in c)]
    if zeros and (not real or _scalar_outputs_only(model, batch[:num_model_inputs])):
        zero = max(zeros, key=lambda c: sum(d == 0 for d in c))
        if notes is not None:
            why = "on the meta device" if not real else "(the model returns only its loss)"
            notes.append(f"batch dim ambiguous {why}; assumed dim 0 (declare batch_dims to override)")
        return zero
    shown = "; ".join(str(c) for c in cands[:4])
    raise AmbiguousBatch(cands, f"{name}: cannot tell the batch dimension of the inputs (candidates per input: {shown}); "
                    "declare batch_dims in the workload (e.g. batch_dims=(1, 0) for a [seq, batch] input "
                    "and a [batch] target)")


class AmbiguousBatch(PlanError):
    """No candidate split gave slices of the full output; `candidates` lists them (the
    compiler then looks for the op that couples the rows, to name it instead)."""

    def __init__(self, candidates: list, message: str):
        super().__init__(message)
        self.candidates = candidates


def _declared(batch, declared, parts, name) -> list:
    if isinstance(declared, int):
        declared = [declared if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in batch]
    declared = list(declared)
    if len(declared) != len(batch):
        raise PlanError(f"{name}: batch_dims has {len(declared)} entries but the batch has {len(batch)} "
                        "(model inputs, then the target)")
    for i, (t, d) in enumerate(zip(batch, declared)):
        if d is None:
            continue
        if not isinstance(t, torch.Tensor) or not -t.dim() <= d < t.dim():
            raise PlanError(f"{name}: batch_dims[{i}]={d} is not a dimension of input {i}")
        if t.shape[d] % parts:
            raise PlanError(f"{name}: input {i} has {t.shape[d]} rows along batch dim {d}, not divisible "
                            f"by dp*m={parts}; use a global batch that is a multiple of {parts}")
    return [None if d is None else d % batch[i].dim() for i, d in enumerate(declared)]


def _candidates(batch, tensors, parts) -> list[list]:
    sizes = set(batch[tensors[0]].shape)
    out = []
    for size in sorted(s for s in sizes if s % parts == 0 and s >= parts):
        per = []
        for i in range(len(batch)):
            if i not in tensors:
                per.append([None])
                continue
            dims = [d for d, s in enumerate(batch[i].shape) if s == size]
            per.append(dims or [None])
        for combo in itertools.product(*per):
            out.append(list(combo))
    return out


def split(t, dim, parts: int, index: int):
    """The index-th of `parts` equal slices of t along dim (t itself when dim is None)."""
    if dim is None or not isinstance(t, torch.Tensor):
        return t
    return t.chunk(parts, dim=dim)[index]


def _slice_matches(model, inputs, dims, parts, full_cache: list | None = None) -> bool:
    """Does the last slice along `dims` give the matching slice of the full batch's output?
    `full_cache`: an empty list the first call fills with the full output, later calls reuse.
    Both runs start from the user's model state, which is put back afterwards."""
    try:
        with probing(model) as restore:
            if full_cache:
                full = full_cache[0]
            else:
                full = _flat(model(*inputs))
                restore()
                if full_cache is not None:
                    full_cache.append(full)
            part = _flat(model(*(split(t, d, parts, parts - 1) for t, d in zip(inputs, dims))))
    except Exception:
        return False
    if len(full) != len(part) or not full:
        return False
    # a scalar (a loss the model returns beside its logits) has no rows to show; the
    # outputs with rows tell the split, and there must be one
    rows = [(f, p) for f, p in zip(full, part) if f.dim() > 0]
    if not rows:
        return False
    for f, p in rows:
        if not any(_is_last_slice(f, p, d) for d in range(f.dim())):
            return False
    return True


def _loss_pairs(model, batch: tuple, num_model_inputs: int, dims: list, parts: int, loss_fn) -> bool:
    """Is the loss of the whole batch the mean or the sum of the parts' losses, each part's
    outputs paired with its own slice of the target along `dims`? (A target cut along
    another dim of the same length pairs outputs with other rows' targets: generically
    neither.)"""
    try:
        with probing(model) as restore:
            inputs, targets = batch[:num_model_inputs], batch[num_model_inputs:]
            whole = float(loss_fn(model(*inputs), *targets))
            losses = []
            for k in range(parts):
                restore()
                part = [split(t, d, parts, k) for t, d in zip(batch, dims)]
                losses.append(float(loss_fn(model(*part[:num_model_inputs]), *part[num_model_inputs:])))
    except Exception:
        return False
    scale = max(abs(whole), 1e-12)
    return abs(sum(losses) / parts - whole) <= 1e-5 * scale or abs(sum(losses) - whole) <= 1e-5 * scale


def _scalar_outputs_only(model, inputs) -> bool:
    """Does the model return only scalars (its loss), so no split can be checked by value?"""
    try:
        with probing(model):
            out = _flat(model(*inputs))
    except Exception:
        return False
    return bool(out) and all(t.dim() == 0 for t in out)


def _is_last_slice(f: torch.Tensor, p: torch.Tensor, d: int) -> bool:
    if f.dim() != p.dim() or any(a != b for k, (a, b) in enumerate(zip(f.shape, p.shape)) if k != d):
        return False
    n = p.shape[d]
    if n >= f.shape[d]:
        return False
    return torch.allclose(f.narrow(d, f.shape[d] - n, n), p, rtol=1e-4, atol=1e-5)


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.float()] if out.is_floating_point() else [out]
    if isinstance(out, dict) or hasattr(out, "values") and not isinstance(out, (list, tuple)):
        return [t for v in out.values() for t in _flat(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flat(v)]
    return []
