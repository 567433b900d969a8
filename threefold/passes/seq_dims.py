"""Find each user input's sequence dimension, for context parallelism (plan cp=N).

The batch dim is found first (passes/batch_dims.py). The sequence length S is read from the
first model input that has a dim besides its batch dim: its one such dim whose size 2*cp
divides (the load-balanced layout cuts each sequence into 2*cp blocks), or one 2*cp does not
divide, padded at its end to a multiple of 2*cp (runtime/cp_ops.pad_to_blocks; the padded
positions stand for nothing, passes/cp_padding.py); where several dims could be it, each is
compiled (compiler/seq_choice.py). Every input (and the target) is split along its one
non-batch dim of size S; an input without one is not split, one with two is refused. The
graph check (passes/cp_rules/) then proves the choice: a wrong dim meets an op with no rule.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from threefold.errors import PlanError


class AmbiguousSeq(PlanError):
    """Input `index` has several dims the sequence could be (`candidates`; `padded`: those 2cp
    does not divide): the compiler then tries each (compiler/seq_choice.py) and keeps the only
    one cp compiles (where several do, one 2cp divides before a padded one)."""

    def __init__(self, msg: str, index: int, candidates: list, padded: list | None = None):
        super().__init__(msg)
        self.index, self.candidates, self.padded = index, candidates, padded or []


def find_seq_dims(batch: tuple, batch_dims: list, num_model_inputs: int, cp: int, name: str = "",
                  chosen: dict | None = None) -> list:
    """One entry per batch entry: its sequence dim, or None where it is not split. `chosen`:
    {input index: dim} where the caller picked among an AmbiguousSeq's candidates."""
    if cp == 1:
        return [None] * len(batch)
    batch_dims = [0 if d is None else d for d in batch_dims]   # not split (dp*m = 1): dim 0
    length = None
    for i, t in enumerate(batch[:num_model_inputs]):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue
        others = [d for d in range(t.dim()) if d != batch_dims[i]]
        cands = [d for d in others if t.shape[d] % (2 * cp) == 0]
        if chosen and i in chosen:
            cands = [chosen[i]]
        elif len(cands) < len(others) and (len(cands) == 1 and len(others) > 1 or not cands):
            # an uneven length is padded to 2cp blocks (cp_ops.pad_to_blocks): beside one dim that
            # divides ([b, 7, 16] embeddings) it is a candidate too, tried after it (seq_choice.py)
            cands = cands + [d for d in others if d not in cands]
        if len(cands) != 1:
            raise AmbiguousSeq(f"{name}: cp={cp} cannot tell the sequence dim of input {i} {tuple(t.shape)} "
                               f"(candidates {cands}); pass the sequence as the one non-batch dim (or the one "
                               f"divisible by {2 * cp})", i, cands, [d for d in cands if t.shape[d] % (2 * cp)])
        length = t.shape[cands[0]]
        break
    if length is None:
        raise PlanError(f"{name}: cp={cp} needs a model input with a sequence dim (besides the batch dim)")
    out = []
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            out.append(None)
            continue
        dims = [d for d in range(t.dim()) if d != batch_dims[i] and t.shape[d] == length]
        like = [j for j in (chosen or {}) if tuple(batch[j].shape) == tuple(t.shape)]
        if len(dims) > 1 and like:   # the chosen input's dim, for it and for values shaped like it (a target)
            dims = [chosen[like[0]]]
        if len(dims) > 1:
            raise PlanError(f"{name}: input {i} {tuple(t.shape)} has {len(dims)} dims of the sequence length "
                            f"{length}; cp cannot tell which to split (a [seq, seq] mask?): use cp=1")
        out.append(dims[0] if dims else None)
    return out


def seq_tail_of(values: tuple, dims: list, cp: int) -> int:
    """Positions the sequence is padded by (runtime/cp_ops.seq_tail; 0 where 2cp divides it)."""
    # lazy: start-up: runtime.cp_ops loads only on this path
    from threefold.runtime.cp_ops import seq_tail
    lengths = [v.shape[d] for v, d in zip(values, dims) if d is not None and isinstance(v, torch.Tensor)]
    return seq_tail(lengths[0], cp) if lengths else 0


def local_share(values: tuple, dims: list, cp: int) -> tuple:
    """The first cp rank's share of each value (blocks 0 and 2cp-1 of the sequence padded to
    2cp blocks, cp_ops.pad_to_blocks): its shape is what we trace."""
    # lazy: start-up: runtime.cp_ops loads only on this path
    from threefold.runtime.cp_ops import local_blocks
    return tuple(local_blocks(v, d, cp, 0) if d is not None and isinstance(v, torch.Tensor) else v
                 for v, d in zip(values, dims))


def full_length_tables(model, length: int, cp: int, cause: str = "") -> list:
    """Parameters and buffers with a dim of the whole sequence length (a learned position
    table added whole, `x + self.pos` as in ViT): (kind, name, shape, dim) per such dim, the
    ones whose shape the trace's error names first (a width equal to the length is a
    coincidence the caller rules out by tracing)."""
    found = []
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for fqn, t in named:
            for d in range(t.dim()):
                if t.shape[d] == length and length % (2 * cp) == 0:
                    found.append((kind, fqn, tuple(t.shape), d))
    return sorted(found, key=lambda f: f"torch.Size({list(f[2])})" not in cause)


def full_length_refusal(model, length: int, cp: int, name: str, cause: str):
    """The cp decision for a model that cannot be traced on this rank's share of the sequence
    because a table of the whole length meets it (a PlanError naming the table and the fix),
    or None where no such table explains `cause`."""
    tables = full_length_tables(model, length, cp, cause)
    if not tables or "broadcast" not in cause:
        return None
    kind, fqn, shape, d = tables[0]
    return PlanError(f"{name}: cp={cp} traces each rank's {length // cp} of the {length} positions, but {kind} "
                     f"`{fqn}` {shape} holds all {length} positions on dim {d} and is used whole (a learned "
                     f"position table added as `x + self.{fqn.rsplit('.', 1)[-1]}`?); slice it to the input's "
                     f"length (`self.{fqn.rsplit('.', 1)[-1]}[:, :x.shape[1]]`: cp then reads this rank's rows "
                     "at their global positions) or use cp=1")


@contextmanager
def read_at_local_length(model, tables: list, n: int):
    """While tracing this rank's share: each full-length table (full_length_tables) reads as
    its first n positions inside its module's forward (`self.pos` is `pos[:, :n]`, a slice of
    the parameter in the graph, under its own name). passes/context_parallel.py finds such
    slices by data flow and reads this rank's rows at their global positions instead; the
    caller checks that every one of them was (else the slice would be wrong)."""
    handles, owners = [], []
    for kind, fqn, _, d in tables:
        owner, _, attr = fqn.rpartition(".")
        mod = model.get_submodule(owner)
        store = mod._parameters if kind == "parameter" else mod._buffers

        def before(m, args, attr=attr, d=d, store=store):
            m.__dict__[attr] = store[attr][(slice(None),) * d + (slice(0, n),)]

        def after(m, args, out, attr=attr):
            m.__dict__.pop(attr, None)
        handles += [mod.register_forward_pre_hook(before), mod.register_forward_hook(after)]
        owners.append((mod, attr))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, attr in owners:
            mod.__dict__.pop(attr, None)
