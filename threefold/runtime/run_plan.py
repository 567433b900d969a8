"""`RunPlan`: the plan as the runtime reads it, from the manifest, without the front end's
`Plan` (threefold/plan.py holds the grammar, the defaults and the checks of a plan the user
writes; the runtime never imports it).

The compiler writes the plan's values into the manifest (`plan_values`, beside its text for
readers), and runtime/manifest.py builds this value from them once. Fields read as
attributes (`run_plan.tp`, `.zero`, `.schedule`...); `str()` is the plan's text, so what is
printed, compared and stored in checkpoints is the same as for the `Plan` it came from.

`InputSplit` is the other half of what the runtime reads once: how a step cuts each user
input of the global batch, derived from the input's placement on the mesh (the manifest's
per-input OnMesh: its `dp` entry, and the entry of every axis that names a cut op in its
mesh entry, runtime/mesh.py `Axis.cut`: cp's load-balanced blocks).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass

from threefold.errors import PlanError
from threefold.placement import OnMesh
from threefold.runtime import mesh as mesh_table
from threefold.runtime.mesh import Mesh

_SCALARS = (bool, int, str, type(None))


class RunPlan:
    __slots__ = ("_values", "_text")

    def __init__(self, values: dict, text: str):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_text", str(text))

    @classmethod
    def of(cls, plan) -> "RunPlan":
        """The run plan of a front-end `Plan` (any dataclass with the plan's fields)."""
        if isinstance(plan, RunPlan):
            return plan
        return cls({f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}, str(plan))

    @classmethod
    def from_json(cls, values, text, where: str = "the manifest") -> "RunPlan":
        """Checked JSON values: every one a scalar (or, split_points, a list of names)."""
        if not isinstance(values, dict) or not isinstance(text, str):
            raise PlanError(f"{where} has no plan values (`plan_values`); recompile the artifact")
        out = {}
        for k, v in values.items():
            if isinstance(v, list) and all(isinstance(x, str) for x in v):
                v = tuple(v)
            elif not isinstance(v, _SCALARS):
                raise PlanError(f"{where} has an invalid plan value {k}={v!r}; recompile the artifact")
            out[str(k)] = v
        for k in ("tp", "pp", "dp", "microbatches", "interleave"):
            v = out.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{where} has an invalid plan value {k}={v!r} (a positive integer); "
                                "recompile the artifact")
        return cls(out, text)

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._values.items()}

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"the plan has no value {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("RunPlan is immutable")

    def get(self, name: str, default=None):
        return self._values.get(name, default)

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"RunPlan({self._text!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RunPlan) and other._values == self._values

    def __hash__(self) -> int:
        return hash(self._text)

    def __reduce__(self):
        return (RunPlan, (self._values, self._text))

    # -- facts derived from the values (the same rules as threefold/plan.py) --------------
    @property
    def shard_degree(self) -> int:
        """Ranks ZeRO shards over: dp unless dp_shard says fewer."""
        d = self._values.get("dp_shard")
        return self.dp if d is None else d

    @property
    def mesh(self) -> Mesh:
        return Mesh.of_plan(self)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def num_chunks(self) -> int:
        return self.pp * self.interleave


@dataclass(frozen=True)
class InputSplit:
    """How a step cuts one user input of the global batch: `batch` is the dim its rows lie
    along, split over the batch axes (dp) and the microbatches; `cuts` the (axis, dim) of each
    other axis that cuts it, by that axis's runtime op (`input_cut`: cp's 2*cp blocks, two per
    cp rank, runtime/cp_ops.local_blocks); None / (): not cut."""
    batch: int | None = None
    cuts: tuple[tuple[str, int], ...] = ()

    @property
    def seq(self) -> int | None:
        """The dim cp cuts (None: none)."""
        return dict(self.cuts).get("cp")

    @classmethod
    def of(cls, on: OnMesh) -> "InputSplit":
        """The split an input's placement says (its `dp` entry and its cutting axes' entries)."""
        cutting = {a.name for a in mesh_table.AXES if a.cut}
        return cls(on.dim("dp"), tuple((a, on.dim(a)) for a in on.axes if a in cutting and on.dim(a) is not None))


def cutting_axes() -> tuple[str, ...]:
    """The mesh axes that cut user inputs by a runtime op of their own, outermost first."""
    return tuple(a.name for a in mesh_table.AXES if a.cut)


@functools.cache
def input_cut(axis: str):
    """The runtime op that cuts a user input along `axis` (its mesh entry's `cut`)."""
    module, name = next(a.cut for a in mesh_table.AXES if a.name == axis).split(":")
    return getattr(importlib.import_module(module), name)
