"""A ParallelModule's (and its optimizer's) state as DCP values, keyed by original FQNs.

Keys: `model.<fqn>` (parameters, frozen ones included, and buffers), `optim.<fqn>.<name>`
(optimizer state: tensors shaped like the parameter are sharded like it, scalars such as
AdamW's step are replicated), `optim.param_groups` (hyperparameters, rank 0), `meta`
(step, extra, the engine's step count; rank 0) and `rng.rank<r>` (each rank's generators).
"""
from __future__ import annotations

import torch

from threefold.checkpoint.layout import Sharded, pieces
from threefold.errors import PlanError
from threefold.runtime.shard import ShardSpec

MODEL, OPTIM, GROUPS, META = "model.", "optim.", "optim.param_groups", "meta"
SCALER = "loss_scaler"   # fp16's dynamic loss scale (runtime/mixed_precision.LossScaler), rank 0


def full_shapes(manifest: dict) -> dict[str, tuple[list[int], str]]:
    shapes = manifest.get("state_shapes")
    if shapes is None:
        raise PlanError("this ParallelModule's manifest has no state_shapes (built by an older threefold): "
                        "compile it again to save or load checkpoints")
    return {k: (list(v[0]), v[1]) for k, v in shapes.items() if not k.startswith("_const.")}


def local_tensors(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters (all, frozen included) and buffers by canonical FQN."""
    out = dict(pm.engine.params)
    for mod in pm.engine.modules.values():
        for fqn, b in mod.named_buffers(remove_duplicate=False):
            if not fqn.startswith("_const.") and fqn not in out:
                out[fqn] = b
    return out


def layout_of(pm, fqn: str, local: torch.Tensor) -> Sharded:
    spec_json = pm.manifest.get("shards", {}).get(fqn)
    spec = ShardSpec.from_json(spec_json) if spec_json else None
    # one entry, not full_shapes' whole table: a save asks for every tensor (it was O(n^2):
    # 34 ms of each save's hold on the step loop for the default job's 160 tensors)
    shape = list((pm.manifest.get("state_shapes") or full_shapes(pm.manifest))[fqn][0])
    dim, parts = pieces(spec, shape, pm.engine.coord.tp)
    s = Sharded(local, dim, parts, shape)
    s.spec = spec
    mesh = pm.engine.mesh
    if pm.manifest.param_on_mesh(fqn).dim("ep") == 0 and mesh.ep > 1:
        # ep: this rank's E/ep experts are rows of the full tensor (runtime/experts.py), so
        # they are saved as those rows, under the same key and full shape as any other plan
        # lazy: start-up: checkpoint.zero_state loads only on this path
        from threefold.checkpoint.zero_state import RowsOf
        if spec is not None and spec.dim == 0:   # RowsOf reads dim 0 as global rows
            raise PlanError(f"{fqn}: an expert weight split over tp along its expert dim cannot be "
                            "saved under ep; checkpoint it with ep=1")
        count = shape[0] // mesh.ep   # dim 0 holds the experts
        rows = RowsOf(s, pm.engine.coord.ep * count, count, local)
        rows.expert_rows = True
        rows.rows_base = (s, pm.engine.coord.ep * count)   # ZeRO rows of these rows compose (zero_state)
        return rows
    owned = pm.manifest.get("expert_modules") or {}
    if fqn in owned and mesh.ep > 1:
        # ep over experts held as separate modules: the expert's rank holds the parameter
        # whole (all of its local rows), every other rank none of it (runtime/expert_modules.py)
        # lazy: start-up: checkpoint.zero_state loads only on this path
        from threefold.checkpoint.zero_state import RowsOf
        rows = RowsOf(s, 0, local.shape[0] if local.dim() else 0, local)
        rows.expert_rows = True
        rows.rows_base = (s, 0)
        return rows
    return s


def model_state(pm) -> dict[str, Sharded]:
    """What `pm.state_dict()` returns: this rank's shards, each with its layout (under
    zero=3 a trainable parameter is this dp_shard rank's rows of it: runtime/fsdp.py)."""
    # lazy: start-up: checkpoint.zero_state loads only on this path
    from threefold.checkpoint.zero_state import rows_within, shape_only
    sharded = pm.engine.sharded
    rows = sharded.rows if sharded is not None and sharded.zero >= 3 else {}
    out = {}
    for fqn, t in local_tensors(pm).items():
        if fqn in rows:   # the parameter's storage may be freed: only its layout is read
            s = rows[fqn]
            layout = rows_within(layout_of(pm, fqn, shape_only(t)), s.start, s.count, s.shard.detach())
            layout.row_sharded = True
        else:
            layout = layout_of(pm, fqn, t.detach())
        out[fqn] = layout
    return out


def holds_unique(pm, layout) -> bool:
    """Whether this rank is the one that counts `layout`'s pieces when the whole model is
    assembled: dp rank 0 for replicated tensors, replica 0 for zero=3's row shards; cp rank 0
    (cp ranks hold the same parameters, like dp replicas)."""
    coord = pm.engine.coord
    if coord["cp"] != 0:                        # cp ranks hold the same parameters
        return False
    if getattr(layout, "expert_rows", False):   # ep: the edp ranks hold equal copies of these experts
        return coord["edp"] == 0
    return (coord["dp_replicate"] if getattr(layout, "row_sharded", False) else coord["dp"]) == 0


def optimizer_params(pm, optimizer):
    """(fqn, the tensor optimizer.state is keyed by, its state's layout) per parameter: the
    parameter (zero=0) or its ZeRO-1 row shard (checkpoint/zero_state.py)."""
    # lazy: start-up: checkpoint.zero_state loads only on this path
    from threefold.checkpoint.zero_state import optimizer_params as params
    return params(pm, optimizer, layout_of)


def optimizer_state(pm, optimizer) -> dict:
    out = {}
    for fqn, p, layout in optimizer_params(pm, optimizer):
        for name, v in optimizer.state.get(p, {}).items():
            key = f"{OPTIM}{fqn}.{name}"
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape:
                out[key] = layout(v.detach())
            elif isinstance(v, torch.Tensor) and v.dim() == 0:
                out[key] = v.detach()
            elif isinstance(v, torch.Tensor):
                raise PlanError(f"optimizer state {name!r} of {fqn} has shape {list(v.shape)}, neither the "
                                f"parameter's {list(p.shape)} nor a scalar: threefold cannot reshard it")
            else:
                out[key] = v
    return out


def param_groups(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(state["cuda"])
        except Exception:   # a different number of devices: the CPU state is still restored
            pass


def load_full_state(pm, full: dict) -> None:
    """Cut this rank's pieces from full tensors (e.g. a single-process model's state_dict)."""
    local = local_tensors(pm)
    missing = [k for k in local if k not in full]
    if missing:
        raise PlanError(f"load_state_dict: no values for {', '.join(missing[:3])}"
                        f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''}: pass every parameter and buffer")
    shapes = full_shapes(pm.manifest)
    layouts = model_state(pm)
    with torch.no_grad():
        for fqn in local:
            src = full[fqn]
            if list(src.shape) != shapes[fqn][0]:
                raise PlanError(f"load_state_dict: {fqn} has shape {list(src.shape)}, the model's is {shapes[fqn][0]}")
            dest = layouts[fqn]
            dest.zero_padding()
            for offs, sizes, view in dest.regions():
                piece = src
                for d, (o, n) in enumerate(zip(offs, sizes)):
                    piece = piece.narrow(d, o, n)
                view.copy_(piece.reshape(view.shape))
