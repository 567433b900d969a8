"""`threefold.load(pm, optimizer, DIR)`: read a checkpoint into this rank's shards, under
any plan of the same model (reshard at load).

Before anything is read into the model: the directory must be a threefold checkpoint
(reader.resolve), every file listed in its index must be present with its size and CRC32,
and its parameter names and full shapes must be this model's (else a PlanError listing the
first differences). Then each rank asks DCP for exactly its own pieces: each saved chunk's
overlap with each local piece is read straight into a view of the parameter or optimizer
moment, so neither the full model nor another rank's shard is ever materialised.
"""
from __future__ import annotations

import torch

from threefold.checkpoint import files, state
from threefold.checkpoint.collective import gather_all, quiet as _quiet, rank_world
from threefold.checkpoint.groups import restore_groups
from threefold.checkpoint.layout import Sharded
from threefold.errors import PlanError


def load(pm, optimizer, directory: str) -> dict:
    """Load the checkpoint at `directory` (a step directory, or a root: its newest) into
    `pm` and `optimizer` (may be None). Returns {"step", "extra", "path"}."""
    import torch.distributed.checkpoint as dcp   # lazy: DCP loads only when a checkpoint is saved or loaded
    rank, world = rank_world()
    # lazy: start-up: checkpoint.reader loads only on this path
    from threefold.checkpoint.reader import CheckedReader, check_meta, read_checkpoint
    try:    # every field checked against the schema (checkpoint/reader.py), never plain pickle
        checked, problem = read_checkpoint(directory, meta=False), None
    except PlanError as exc:
        checked, problem = None, str(exc)
    refused = [p for p in gather_all(problem) if p]     # every rank stops, not only the one that saw it
    if refused:
        raise PlanError(refused[0])
    ckpt, index, md = checked.path, checked.index, checked.metadata
    problems = [p for p in gather_all(files.check_files(ckpt, index, rank, world)) if p]
    if problems:
        raise PlanError(f"checkpoint {ckpt}: {problems[0]}; load an earlier checkpoint")
    # lazy: start-up: checkpoint.save loads only on this path
    from threefold.checkpoint.save import _buffer_names
    # buffers one plan reads and another does not (cp's ring drops the causal-mask buffer) are
    # constants of the model: missing ones keep the model's values, extra ones are not read
    own_buffers, saved_buffers = _buffer_names(pm.manifest), set(index.get("buffers", ()))
    _check_same_model(ckpt, md, state.full_shapes(pm.manifest), own_buffers, saved_buffers)
    gap = files.coverage_problem(md)
    if gap:
        raise PlanError(f"checkpoint {ckpt} is incomplete: {gap}")

    sd: dict = {}
    saved_keys = set(md.state_dict_metadata)
    for fqn, dest in state.model_state(pm).items():
        if fqn in own_buffers and state.MODEL + fqn not in saved_keys:
            continue
        dest.zero_padding()
        sd[state.MODEL + fqn] = dest
    moments = _optimizer_targets(pm, optimizer, md) if optimizer is not None else {}
    for key, (_, _, value) in moments.items():
        sd[key] = value
    if optimizer is not None and state.GROUPS in md.state_dict_metadata:
        sd[state.GROUPS] = None
    scaler = getattr(optimizer, "scaler", None)   # fp16 (runtime/mixed_precision.LossScaler)
    if scaler is not None and state.SCALER in md.state_dict_metadata:
        sd[state.SCALER] = None
    sd[state.META] = None
    same_layout = index.get("plan") == str(pm.plan) and index.get("world") == world
    rng_key = f"rng.rank{rank if same_layout else 0}"
    if rng_key in md.state_dict_metadata:
        sd[rng_key] = None
    # lazy: start-up: checkpoint.planners loads only on this path
    from threefold.checkpoint.planners import LoadShards
    # lazy: start-up: checkpoint.safe_read loads only on this path
    from threefold.checkpoint.safe_read import unwrapped
    try:
        with torch.no_grad():
            with _quiet(world), unwrapped():
                dcp.load(sd, storage_reader=CheckedReader(ckpt, md), planner=LoadShards(), no_dist=world == 1)
    except PlanError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise PlanError(f"checkpoint {ckpt}: reading it failed ({type(exc).__name__}: {first}); "
                        "the checkpoint is damaged, load an earlier one") from None

    meta = check_meta(ckpt, sd[state.META], index, strict=False) or {}     # before any of it is used
    groups = "none"
    if optimizer is not None:     # groups matched by their parameters (checkpoint/groups.py)
        groups = restore_groups(pm, optimizer, sd.get(state.GROUPS))
        _apply_optimizer(optimizer, moments, sd)
    if scaler is not None and sd.get(state.SCALER):
        scaler.load_state_dict(sd[state.SCALER])
        pm.engine.set_loss_scale(scaler.scale)
    pm.engine.restore_counters(meta.get("engine_step"), meta.get("rng_base"))
    if sd.get(rng_key):
        state.set_rng_state(sd[rng_key])
    return {"step": meta.get("step"), "extra": meta.get("extra"), "path": ckpt, "optimizer_groups": groups}


def _check_same_model(ckpt: str, md, expected: dict, own_buffers=frozenset(), saved_buffers=frozenset()) -> None:
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    saved = {k[len(state.MODEL):]: list(m.size) for k, m in md.state_dict_metadata.items()
             if k.startswith(state.MODEL) and isinstance(m, TensorStorageMetadata)}
    missing = [k for k in expected if k not in saved and k not in own_buffers]
    unexpected = [k for k in saved if k not in expected and k not in saved_buffers]
    shapes = [f"{k} saved {saved[k]} vs model {expected[k][0]}" for k in expected
              if k in saved and saved[k] != expected[k][0]]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for what, items in (("missing from the checkpoint", missing), ("not in this model", unexpected),
                        ("shapes differ", shapes)):
        if items:
            more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
            parts.append(f"{what}: {', '.join(items[:3])}{more}")
    raise PlanError(f"checkpoint {ckpt} is of another model ({'; '.join(parts)}): load a checkpoint "
                    "saved from this model")


def _optimizer_targets(pm, optimizer, md) -> dict:
    """key -> (param, state name, destination) for every saved state of this rank's params."""
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    shapes = state.full_shapes(pm.manifest)
    by_param = {}
    for key in md.state_dict_metadata:
        if key.startswith(state.OPTIM) and key != state.GROUPS:
            fqn, _, name = key[len(state.OPTIM):].rpartition(".")
            by_param.setdefault(fqn, []).append((key, name))
    out = {}
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for fqn, p, layout in state.optimizer_params(pm, optimizer):   # zero=1: row shards
        if id(p) not in mine:
            continue
        current = optimizer.state.get(p, {})
        for key, name in by_param.get(fqn, []):
            m = md.state_dict_metadata[key]
            if isinstance(m, TensorStorageMetadata) and len(m.size) and list(m.size) == shapes[fqn][0]:
                value = layout(torch.zeros_like(p, dtype=m.properties.dtype))
            elif isinstance(m, TensorStorageMetadata) and not len(m.size):
                old = current.get(name)
                device = old.device if isinstance(old, torch.Tensor) else "cpu"
                value = torch.zeros((), dtype=m.properties.dtype, device=device)
            elif isinstance(m, TensorStorageMetadata):
                raise PlanError(f"checkpoint optimizer state {key} has shape {list(m.size)}, neither "
                                f"{fqn}'s {shapes[fqn][0]} nor a scalar: it cannot be resharded")
            else:
                value = None
            out[key] = (p, name, value)
    return out


def _apply_optimizer(optimizer, moments: dict, sd: dict) -> None:
    fresh: dict = {}
    for key, (p, name, _) in moments.items():
        v = sd[key]
        fresh.setdefault(p, {})[name] = v.local if isinstance(v, Sharded) else v
    for p, st in fresh.items():
        optimizer.state[p] = st

