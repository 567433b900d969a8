"""`threefold export CKPT --out DIR --adapters --peft-config CFG`: LoRA adapters in PEFT's format.

A model fine-tuned with PEFT's LoRA (a `PeftModel`, or a module holding one, parallelized
as it is) trains only its adapter weights; their checkpoint tensors are named like
`...q_proj.lora_A.default.weight`, the segment `default` being the adapter's name. PEFT's
on-disk adapter (what `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained(base,
DIR)` reads) is

- `adapter_model.safetensors`: the adapter's tensors only, each under its name in the
  `PeftModel` with the adapter-name segment removed (`base_model.model.<path>.lora_A.weight`);
- `adapter_config.json`: the LoRA config (r, lora_alpha, target_modules, ...).

The adapter's tensors are the checkpoint's tensors with the adapter-name segment in their
name. Every trainable tensor (one with optimizer state in the checkpoint) must be one of
them: a trained tensor outside the adapter (PEFT's modules_to_save, an unfrozen bias) would
be lost, so it is a PlanError that says to export the full model instead. The scale
(lora_alpha / r) is not in the weights, so the LoRA config the model was built with is given
(--peft-config: adapter_config.json, or a directory holding it, as
`peft_model.peft_config["default"].save_pretrained(DIR)` writes it); its r is checked
against the tensors' shapes and it is written unchanged.
"""
from __future__ import annotations

import json
import os

import torch

from threefold.checkpoint import state
from threefold.errors import PlanError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."     # a PeftModel's own prefix for the wrapped model's names


def read_peft_config(path: str | None) -> dict:
    """The LoRA config as a dict, from adapter_config.json or a directory holding it."""
    if path is None:
        raise PlanError("--adapters needs --peft-config: the LoRA config the model was built with "
                        "(lora_alpha is not in the weights), e.g. the directory "
                        "peft_model.peft_config['default'].save_pretrained(DIR) writes")
    file = os.path.join(path, CONFIG) if os.path.isdir(path) else path
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise PlanError(f"--peft-config {path}: cannot read {file} ({type(exc).__name__}); "
                        f"pass a PEFT {CONFIG} or a directory holding one") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise PlanError(f"--peft-config {path}: not a LoRA config (peft_type is "
                        f"{config.get('peft_type') if isinstance(config, dict) else None!r}, expected LORA)")
    return config


def _without_segment(fqn: str, segment: str) -> str | None:
    """fqn with its last path segment equal to `segment` removed, or None without one."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == segment:
            return ".".join(parts[:i] + parts[i + 1:])
    return None


def peft_key(fqn: str, adapter: str) -> str | None:
    """The PEFT adapter file's key for checkpoint tensor `fqn`, None when it is not the adapter's.
    The name is made relative to the PeftModel: a holder module's prefix before
    `base_model.model.` is dropped; a name without it (adapters injected into a plain
    model) gets it."""
    key = _without_segment(fqn, adapter)
    if key is None:
        return None
    at = key.rfind(PEFT_PREFIX)
    if at > 0 and key[at - 1] == ".":
        return key[at:]
    return key if at == 0 else PEFT_PREFIX + key


def trained_names(ckpt: str) -> set[str]:
    """FQNs of the parameters with optimizer state in the checkpoint (the trained ones)."""
    # lazy: start-up: checkpoint.reader loads only on this path
    from threefold.checkpoint.reader import read_checkpoint
    md = read_checkpoint(ckpt, meta=False).metadata
    model = {k[len(state.MODEL):] for k in md.state_dict_metadata if k.startswith(state.MODEL)}
    trained = set()
    for key in md.state_dict_metadata:
        if key.startswith(state.OPTIM) and key != state.GROUPS:
            fqn = key[len(state.OPTIM):].rsplit(".", 1)[0]
            if fqn in model:
                trained.add(fqn)
    return trained


def adapter_tensors(full: dict[str, torch.Tensor], trained: set[str], adapter: str,
                    config: dict) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's keys; a PlanError if training changed anything else
    or the config's rank does not fit them."""
    out = {}
    for fqn in sorted(full):
        key = peft_key(fqn, adapter)
        if key is not None:
            out[key] = full[fqn]
    if not out:
        raise PlanError(f"the checkpoint has no tensor of an adapter named {adapter!r} (no name with a "
                        f"'.{adapter}.' segment): pass --adapter-name, or export the full model without --adapters")
    outside = sorted(f for f in trained if peft_key(f, adapter) is None)
    if outside:
        raise PlanError(f"trained tensor {outside[0]}{f' (+{len(outside) - 1} more)' if len(outside) > 1 else ''} "
                        f"is not part of adapter {adapter!r}, and an adapter export would lose it: "
                        "export the full model without --adapters")
    r = config.get("r")
    if not config.get("rank_pattern"):
        for key, t in out.items():
            if ".lora_A." in key + "." and t.dim() >= 2 and t.shape[0] != r:
                raise PlanError(f"{key} has rank {t.shape[0]}, --peft-config says r={r}: "
                                "pass the config the model was built with")
    return out


def export_adapters(ckpt_path: str, out: str, peft_config: str | None, adapter: str = "default",
                    force: bool = False) -> dict:
    """Write the checkpoint's LoRA adapter to `out` in PEFT's format."""
    from threefold.dir_lock import dir_lock   # lazy: start-up: dir_lock loads only on this path
    from threefold.outdir import check_out_dir   # lazy: start-up: outdir loads only on this path
    config = read_peft_config(peft_config)     # bad input first, before any work
    check_out_dir(out, force)
    with dir_lock(out):
        return _export_adapters(ckpt_path, out, config, adapter, force)


def _export_adapters(ckpt_path, out, config, adapter, force) -> dict:
    # lazy: safetensors loads only when weight files are read or written
    from safetensors.torch import save_file
    # lazy: start-up: checkpoint.export loads only on this path
    from threefold.checkpoint.export import consolidate
    # lazy: start-up: file_modes loads only on this path
    from threefold.file_modes import as_if_created_plainly
    from threefold.outdir import write_out_dir   # lazy: start-up: outdir loads only on this path
    ckpt, full = consolidate(ckpt_path)
    tensors = adapter_tensors(full, trained_names(ckpt), adapter, config)

    def fill(tmp: str) -> None:
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, os.path.join(tmp, WEIGHTS),
                  metadata={"format": "pt"})
        as_if_created_plainly(os.path.join(tmp, WEIGHTS))
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)

    write_out_dir(out, fill, kind="export", force=force)
    return {"checkpoint": ckpt, "out": os.path.abspath(out), "tensors": len(tensors),
            "bytes": sum(v.numel() * v.element_size() for v in tensors.values()), "files": [WEIGHTS, CONFIG]}
