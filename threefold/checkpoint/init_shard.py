"""Initialise a parameter the weights file lacks, on this rank's shard only.

The owning module's own initialiser (`reset_parameters()`, or a Hugging Face model's
`_init_weights(module)`) runs once on the meta device under a recording dispatch mode.
What it does to each parameter becomes a recipe of in-place element-wise steps with
scalar arguments: `uniform_(-b, b)`, `normal_(0, s)`, `fill_(1)`, `erfinv_()`, `mul_(c)`,
`clamp_(lo, hi)`, and the same on one row (`weight[padding_idx].zero_()`). The scalars
carry everything the full shape decides (fan-in, std), and every element is drawn on its
own, so the recipe can be replayed on any slice of the tensor.

Random draws are made row by row along dim 0 of the full tensor, row i from a generator
seeded by (FQN, i). A shard holding rows r..r+n draws exactly those rows; a shard split
along another dim draws its full rows one at a time and keeps its columns. So a rank holds
its shard plus at most one row, and the values do not depend on the plan: the shards of
any tp degree assemble into the tensor a single process draws (`init_full`).

An initialiser that does anything else to a parameter (reads another tensor into it, a
select along another dim) or nothing visible on meta (torch's `trunc_normal_` and
`orthogonal_` return early for meta tensors; trunc_normal_ also resamples data-dependently)
cannot be replayed; that parameter falls back to materialising its own full tensor once,
seeded by its FQN, and cutting the shard.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from threefold.errors import PlanError

_aten = torch.ops.aten
# in-place element-wise steps whose other arguments are scalars
_RANDOM = {_aten.uniform_.default, _aten.normal_.default, _aten.exponential_.default,
           _aten.log_normal_.default, _aten.cauchy_.default, _aten.geometric_.default,
           _aten.bernoulli_.float, _aten.random_.default, getattr(_aten.random_, "from"), _aten.random_.to}
_DETERMINISTIC = {_aten.fill_.Scalar, _aten.zero_.default, _aten.erfinv_.default, _aten.mul_.Scalar,
                  _aten.add_.Scalar, _aten.sub_.Scalar, _aten.div_.Scalar, _aten.clamp_.default,
                  _aten.clamp_min_.default, _aten.clamp_max_.default, _aten.sqrt_.default,
                  _aten.abs_.default, _aten.neg_.default, _aten.exp_.default}
_ALIASES = {_aten.detach.default, _aten.alias.default}
# `t.mul_(0.3)` reaches the dispatcher as mul_.Tensor with a 0-d CPU tensor: the scalar form
_SCALAR_FORM = {_aten.mul_.Tensor: _aten.mul_.Scalar, _aten.add_.Tensor: _aten.add_.Scalar,
                _aten.sub_.Tensor: _aten.sub_.Scalar, _aten.div_.Tensor: _aten.div_.Scalar,
                _aten.fill_.Tensor: _aten.fill_.Scalar}


@dataclass(frozen=True)
class Step:
    row: int | None           # None: the whole tensor; else one row along dim 0
    op: object                # an aten in-place overload
    args: tuple               # its scalar arguments after self
    kwargs: tuple             # (name, value) pairs, the generator left out

    @property
    def random(self) -> bool:
        return self.op in _RANDOM


class _Recorder(TorchDispatchMode):
    """Records each parameter's steps; marks a parameter unreplayable on anything else."""

    def __init__(self, params: dict[str, torch.Tensor]):
        super().__init__()
        self.by_storage = {p.untyped_storage()._cdata: name for name, p in params.items()}
        self.views: dict[int, tuple[str, int | None]] = {id(p): (name, None) for name, p in params.items()}
        self.steps: dict[str, list[Step]] = {name: [] for name in params}
        self.unreplayable: set[str] = set()

    def _owner(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        try:
            return self.by_storage.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        touched = {self._owner(a) for a in list(args) + list(kwargs.values())} - {None}
        if not touched:
            return out
        target, rest = (args[0] if args else None), args[1:]
        if func in _SCALAR_FORM and all(not isinstance(a, torch.Tensor) or (a.dim() == 0 and not a.is_meta
                                                                            and self._owner(a) is None)
                                        for a in rest):
            func, rest = _SCALAR_FORM[func], tuple(a.item() if isinstance(a, torch.Tensor) else a for a in rest)
        name = self._owner(target)
        where = self.views.get(id(target))
        scalars_only = not any(isinstance(a, torch.Tensor) for a in rest) and not any(
            isinstance(v, torch.Tensor) for k, v in kwargs.items() if k != "generator")
        if name is not None and where is not None and len(touched) == 1 and scalars_only:
            if func in _ALIASES:
                self.views[id(out)] = where
                return out
            if func is _aten.select.int and where[1] is None and rest[0] == 0:
                self.views[id(out)] = (name, int(rest[1]))
                return out
            if func in _RANDOM or func in _DETERMINISTIC:
                kw = tuple(sorted((k, v) for k, v in kwargs.items() if k != "generator"))
                self.steps[name].append(Step(where[1], func, tuple(rest), kw))
                self.views[id(out)] = where      # an in-place op returns its (aliased) self
                return out
        if func._schema.is_mutable or any(func._schema.arguments[i].alias_info is not None
                                          for i in range(min(len(args), len(func._schema.arguments)))):
            self.unreplayable |= touched   # a write (or a view) we cannot replay on a slice
        return out


class ShardInit:
    """Recipes of the model's own initialisers, recorded once per owning module."""

    def __init__(self, model: torch.nn.Module, where: str):
        self.model = model
        self.where = where                      # the weights path, for messages
        self._recipes: dict[str, list[Step] | None] = {}

    def recipe(self, fqn: str) -> list[Step] | None:
        """The steps that initialise `fqn`, or None when they cannot be replayed on a slice."""
        if fqn not in self._recipes:
            owner_name, _, _ = fqn.rpartition(".")
            owner = self._owner(owner_name)
            params = {f"{owner_name}.{n}" if owner_name else n: p
                      for n, p in owner.named_parameters(recurse=False) if p.is_meta}
            if not params:
                self._recipes[fqn] = None
            else:
                rec = _Recorder(params)
                try:
                    with rec, torch.no_grad():
                        self._initialise(owner)
                except PlanError:
                    raise
                except Exception:
                    rec.unreplayable |= set(params)
                for name in params:   # nothing recorded: an initialiser that skips meta tensors
                    steps = rec.steps[name]
                    self._recipes[name] = None if name in rec.unreplayable or not steps else steps
        return self._recipes[fqn]

    def _owner(self, owner_name: str) -> torch.nn.Module:
        return self.model.get_submodule(owner_name) if owner_name else self.model

    def _initialise(self, owner: torch.nn.Module) -> None:
        if hasattr(owner, "reset_parameters"):
            owner.reset_parameters()
        elif hasattr(self.model, "_init_weights"):     # transformers' PreTrainedModel convention
            self.model._init_weights(owner)
        else:
            raise PlanError(f"a parameter of {type(owner).__name__} is not in the weights {self.where} and the "
                            "module has no reset_parameters(): add it to the weights, or build the model "
                            "on a real device")

    def fill(self, dest: torch.Tensor, fqn: str, full_shape, dim: int, parts) -> torch.Tensor:
        """Write `fqn`'s initial values for this rank's pieces (layout.pieces) into `dest`."""
        steps = self.recipe(fqn)
        with torch.no_grad():
            dest.zero_()                     # padded vocabulary rows stay zero
            if steps is None:
                full = self._materialise(fqn, full_shape)
                if not dest.dim():
                    return dest.copy_(full)
                for p in parts:
                    dest.narrow(dim, p.local, p.length).copy_(full.narrow(dim, p.start, p.length))
                return dest
            if not dest.dim():
                _apply(dest, steps, None, _seed(fqn, 0))
                return dest
            if dim == 0:
                for p in parts:
                    for k in range(p.length):
                        _apply(dest[p.local + k], steps, p.start + k, _seed(fqn, p.start + k))
                return dest
            row = torch.empty(list(full_shape)[1:], dtype=dest.dtype)
            for i in range(int(full_shape[0])):
                _apply(row, steps, i, _seed(fqn, i))
                for p in parts:
                    dest[i].narrow(dim - 1, p.local, p.length).copy_(row.narrow(dim - 1, p.start, p.length))
            return dest

    def init_full(self, fqn: str, full_shape, dtype=torch.float32) -> torch.Tensor:
        """The whole tensor every layout's shards assemble into."""
        # lazy: start-up: checkpoint.layout loads only on this path
        from threefold.checkpoint.layout import pieces
        out = torch.empty(list(full_shape), dtype=dtype)
        dim, parts = pieces(None, full_shape, 0)
        return self.fill(out, fqn, full_shape, dim, parts)

    def _materialise(self, fqn: str, full_shape) -> torch.Tensor:
        """Fallback: the owning module's initialiser on a real copy of its own parameters
        only, seeded by the FQN; the module is put back on the meta device afterwards."""
        owner_name, _, leaf = fqn.rpartition(".")
        owner = self._owner(owner_name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(fqn.encode()))
            owner.to_empty(device="cpu", recurse=False)
            try:
                with torch.no_grad():
                    self._initialise(owner)
                full = getattr(owner, leaf).detach().clone()
            finally:
                owner.to_empty(device="meta", recurse=False)
        return full


def _seed(fqn: str, row: int) -> int:
    return (zlib.crc32(fqn.encode()) << 31) ^ row


def _apply(t: torch.Tensor, steps: list[Step], row: int | None, seed: int) -> None:
    """Run `steps` on `t`, which is row `row` of the full tensor (None: a 0-d tensor)."""
    gen = None
    for s in steps:
        if s.row is not None and s.row != row:
            continue
        kwargs = dict(s.kwargs)
        if s.random:
            if gen is None:
                gen = torch.Generator().manual_seed(seed)
            kwargs["generator"] = gen
        s.op(t, *s.args, **kwargs)
