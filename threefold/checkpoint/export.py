"""`threefold export CKPT --out DIR [--hf-config CFG] [--max-shard-size 5GB]`: safetensors.

Up to --max-shard-size the weights are one file, `model.safetensors`; past it they are
Hugging Face's sharded layout, `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` (each tensor's file), which `from_pretrained` and
`parallelize(weights=DIR)` both read. Tensors are packed in name order; one larger than the
limit gets a file of its own.

The checkpoint's pieces (any plan) are read back into full tensors in this process with
DCP (the same checks as load first: index, every file's size and CRC, full coverage).
Without --hf-config the tensors are written under the model's FQNs. With a Hugging Face
config (a directory with config.json), the names are the transformers model's own: its
state_dict is built on the meta device from the config, and each of its keys is found
among the checkpoint's FQNs as the FQN itself or its ending (a wrapper's `model.` prefix
dropped). A key with no match is a PlanError, unless the transformers model ties it to a
key that has one (lm_head to the embedding). config.json is written next to the weights,
so `from_pretrained(DIR)` loads it. A checkpoint of `threefold train`'s embedded GPT (its
run records the GPT's config) is written as a GPT-2 (models/gpt_hf.py) with or without
--hf-config: a GPT2Config is written for it, or the given one is checked against it.
"""
from __future__ import annotations

import json
import math
import os

import torch

from threefold.checkpoint import files, state
from threefold.errors import PlanError


def consolidate(ckpt_path: str) -> tuple[str, dict[str, torch.Tensor]]:
    """Full tensors of every model parameter and buffer in the checkpoint, by FQN."""
    import torch.distributed.checkpoint as dcp   # lazy: DCP loads only when a checkpoint is saved or loaded
    # lazy: DCP loads only when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    # lazy: start-up: checkpoint.collective loads only on this path
    from threefold.checkpoint.collective import quiet
    # lazy: start-up: checkpoint.reader loads only on this path
    from threefold.checkpoint.reader import CheckedReader, read_checkpoint
    # lazy: start-up: checkpoint.safe_read loads only on this path
    from threefold.checkpoint.safe_read import SafeLoadPlanner, unwrapped
    checked = read_checkpoint(ckpt_path, meta=False)   # every field checked, sizes bounded by the files
    ckpt, md = checked.path, checked.metadata
    problem = files.check_files(ckpt, checked.index, 0, 1)
    if problem:
        raise PlanError(f"checkpoint {ckpt}: {problem}; export an earlier checkpoint")
    gap = files.coverage_problem(md)
    if gap:
        raise PlanError(f"checkpoint {ckpt} is incomplete: {gap}")
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if k.startswith(state.MODEL) and isinstance(m, TensorStorageMetadata)}
    with quiet(1), unwrapped():
        dcp.load(sd, storage_reader=CheckedReader(ckpt, md), planner=SafeLoadPlanner(), no_dist=True)
    return ckpt, {k[len(state.MODEL):]: v for k, v in sd.items()}


def hf_names(full: dict[str, torch.Tensor], hf_config: str):
    """(tensors under the transformers model's keys, its config)."""
    # lazy: transformers loads only for Hugging Face models
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(hf_config)
    except Exception as exc:
        raise PlanError(f"--hf-config {hf_config}: not a Hugging Face config ({type(exc).__name__}); "
                        "pass a directory with config.json") from None
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    target = hf.state_dict(keep_vars=True)
    out, missing = {}, []
    for key, t in target.items():
        match = [f for f in full if f == key or f.endswith("." + key)]
        if len(match) == 1:
            if list(full[match[0]].shape) != list(t.shape):
                raise PlanError(f"checkpoint tensor {match[0]} has shape {list(full[match[0]].shape)}, the "
                                f"config's {key} is {list(t.shape)}: this config is of another model")
            out[key] = full[match[0]]
        else:
            missing.append(key)
    ptr = {}
    for key, t in target.items():
        ptr.setdefault(id(t), []).append(key)
    untied = [k for k in missing if not any(o in out for o in ptr[id(target[k])])]
    if untied:
        raise PlanError(f"the checkpoint has no tensor for {', '.join(untied[:3])}"
                        f"{f' (+{len(untied) - 3} more)' if len(untied) > 3 else ''} of the config's model: "
                        "export with the config the model was built from")
    return out, config


DEFAULT_MAX_SHARD = 5 * 10**9       # transformers' own default for save_pretrained
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (a PlanError when unreadable)."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper().replace(" ", "")
    digits = t.rstrip("KMGTIB")
    try:
        n = float(digits) * _UNITS[t[len(digits):]]
    except (ValueError, KeyError):
        raise PlanError(f"--max-shard-size {text!r} is not a size: write e.g. 5GB, 500MB or 2GiB") from None
    if not math.isfinite(n):     # nan and inf parse as floats
        raise PlanError(f"--max-shard-size {text!r} is not a finite size: write e.g. 5GB, 500MB or 2GiB")
    if n < 1:
        raise PlanError(f"--max-shard-size {text!r} must be positive")
    return int(n)


def shard_groups(full: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names packed into files of at most max_bytes, in name order."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(full):
        n = full[name].numel() * full[name].element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def embedded_gpt_names(full: dict[str, torch.Tensor], gpt: dict, hf_config: str | None, where: str = ""):
    """(tensors under GPT-2's keys, its config) for a checkpoint of the embedded GPT whose
    GPTConfig fields are `gpt` (models/gpt_hf.py): `hf_config` if given (checked to describe
    the same function), else the GPT2Config written for it."""
    # lazy: start-up: checkpoint.run_record loads only on this path
    from threefold.checkpoint.run_record import gpt_config
    # lazy: start-up: models.gpt_hf loads only on this path
    from threefold.models.gpt_hf import check_gpt2_config, gpt2_config, gpt2_state
    cfg = gpt_config(gpt, {k: tuple(v.shape) for k, v in full.items()}, where or "the checkpoint")
    if hf_config is None:
        config = gpt2_config(cfg)
    else:
        from transformers import AutoConfig   # lazy: transformers loads only for Hugging Face models
        try:
            config = AutoConfig.from_pretrained(hf_config)
        except Exception as exc:
            raise PlanError(f"--hf-config {hf_config}: not a Hugging Face config ({type(exc).__name__}); "
                            "pass a directory with config.json") from None
        check_gpt2_config(config, cfg)
    return gpt2_state(full, config), config


def export(ckpt_path: str, out: str, hf_config: str | None = None, force: bool = False,
           max_shard_size=DEFAULT_MAX_SHARD, run_record=None) -> dict:
    """Write the checkpoint's weights to `out`. `run_record(ckpt)`: what `threefold train`
    recorded in the checkpoint (cli/generate_cmd.read_generate_info); with the embedded
    GPT's config in it ("gpt"), the export is a GPT-2 directory."""
    from threefold.outdir import check_out_dir   # lazy: start-up: outdir loads only on this path
    max_bytes = parse_size(max_shard_size)
    check_out_dir(out, force)
    from threefold.dir_lock import dir_lock   # lazy: start-up: dir_lock loads only on this path
    with dir_lock(out):     # one export (or run) per --out from here to the written directory
        return _export(ckpt_path, out, hf_config, force, max_bytes, run_record)


def _export(ckpt_path, out, hf_config, force, max_bytes, run_record) -> dict:
    # lazy: safetensors loads only when weight files are read or written
    from safetensors.torch import save_file
    # lazy: start-up: file_modes loads only on this path
    from threefold.file_modes import as_if_created_plainly
    # lazy: start-up: checkpoint.weights loads only on this path
    from threefold.checkpoint.weights import INDEX
    from threefold.outdir import write_out_dir   # lazy: start-up: outdir loads only on this path
    ckpt, full = consolidate(ckpt_path)
    config = None
    embedded_gpt = (run_record(ckpt) if run_record is not None else {}).get("gpt")
    if embedded_gpt is not None:
        full, config = embedded_gpt_names(full, embedded_gpt, hf_config, ckpt)
    elif hf_config is not None:
        full, config = hf_names(full, hf_config)
    groups = shard_groups(full, max_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    total = sum(v.numel() * v.element_size() for v in full.values())

    def fill(tmp: str) -> None:
        for file, keys in zip(names, groups):
            # safetensors refuses shared storage: tied entries are written as separate copies
            save_file({k: full[k].contiguous().clone() for k in keys}, os.path.join(tmp, file),
                      metadata={"format": "pt"})
            as_if_created_plainly(os.path.join(tmp, file))   # safetensors writes 0600: the umask's mode
        if len(groups) > 1:
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total},
                           "weight_map": {k: file for file, keys in zip(names, groups) for k in keys}}, f, indent=1)
        if config is not None:
            config.save_pretrained(tmp)

    write_out_dir(out, fill, kind="export", force=force)
    return {"checkpoint": ckpt, "out": os.path.abspath(out), "tensors": len(full), "bytes": total,
            "files": names}
