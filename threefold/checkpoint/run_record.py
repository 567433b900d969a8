"""What `threefold train` records in a checkpoint for `generate`/`export` (extra["generate"]),
checked as data: the embedded GPT's config (numbers, bounded by the saved tensors' shapes
before the model is built), its tokenizer record, and a SPEC that is only ever a hint."""
from __future__ import annotations

import dataclasses
import os

from threefold.errors import PlanError

MAX_BLOCK = 2**15        # the GPT's causal mask is block_size**2 bools: 1 GiB at this size


def _int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def is_file_spec(spec: str) -> bool:
    """`path/to/file.py:factory` (a file the user has), not `pkg.module:callable`."""
    target = spec.rpartition(":")[0]
    return target.endswith(".py") and os.path.isabs(target)


def check_generate(gen) -> tuple[str, str] | None:
    """(field, why) for the first field of the generate record outside its schema, or None."""
    if not isinstance(gen, dict):
        return "", f"is a {type(gen).__name__}, not a dict"
    if "spec" in gen and not (isinstance(gen["spec"], str) and ":" in gen["spec"] and len(gen["spec"]) < 4096):
        return "spec", "is not a SPEC string"
    sizes = gen.get("sizes", {})
    if not (isinstance(sizes, dict) and all(k in ("batch", "seq") and _int(v, 1, 2**31) for k, v in sizes.items())):
        return "sizes", "is not {batch, seq} of positive integers"
    if gen.get("context") is not None and not _int(gen["context"], 1, 2**31):
        return "context", "is not a positive integer"
    if "gpt" in gen and not isinstance(gen["gpt"], dict):
        return "gpt", "is not a dict"
    if "tokenizer" in gen and not isinstance(gen["tokenizer"], dict):
        return "tokenizer", "is not a dict"
    return None


def gpt_config(record: dict, shapes: dict | None, where: str):
    """The GPTConfig `record` describes, its fields typed and in range and (with `shapes`, the
    saved tensors' FQN -> shape) matching the saved embeddings and layers."""
    from threefold.models.gpt import GPTConfig   # lazy: start-up: models.gpt loads only on this path
    known = {f.name for f in dataclasses.fields(GPTConfig)}

    def bad(name: str, why: str) -> PlanError:
        return PlanError(f"checkpoint file {os.path.join(where, '.metadata')} (entry 'meta'): field "
                         f"'extra.generate.gpt.{name}' {why}; the checkpoint is damaged or was edited "
                         "(or give --spec SPEC)")

    unknown = sorted(set(record) - known)
    if unknown:
        raise bad(unknown[0], "is not a GPTConfig field")
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        if name in record and not _int(record[name], 1, 2**31):
            raise bad(name, "is not a positive integer")
    if "dropout" in record and not (type(record["dropout"]) in (int, float) and 0 <= record["dropout"] < 1):
        raise bad("dropout", "is not a number in [0, 1)")
    if "bias" in record and not isinstance(record["bias"], bool):
        raise bad("bias", "is not true or false")
    cfg = GPTConfig(**record)
    if cfg.n_embd % cfg.n_head:
        raise bad("n_head", f"({cfg.n_head}) does not divide n_embd {cfg.n_embd}")
    if cfg.block_size > MAX_BLOCK:
        raise bad("block_size", f"is {cfg.block_size}, more than {MAX_BLOCK}")
    if shapes is not None:
        want = {"wte.weight": (cfg.vocab_size, cfg.n_embd), "wpe.weight": (cfg.block_size, cfg.n_embd)}
        for name, shape in want.items():
            if tuple(shapes.get(name, ())) != shape:
                raise bad("vocab_size/block_size/n_embd", f"gives {name} {list(shape)}, but the checkpoint "
                          f"holds {list(shapes.get(name, ()))}")
        layers = {k.split(".")[1] for k in shapes if k.startswith("h.")}
        if len(layers) != cfg.n_layer:
            raise bad("n_layer", f"is {cfg.n_layer}, but the checkpoint holds {len(layers)} layers")
    return cfg


def tokenizer_record(record, where: str):
    """The tokenizer a record describes (byte, or a tokenizers JSON as data, never code)."""
    # lazy: start-up: dataset.tokenizer loads only on this path
    from threefold.dataset.tokenizer import tokenizer_from_dict
    if not isinstance(record, dict) or record.get("kind") not in ("byte", "hf") or (
            record.get("kind") == "hf" and not isinstance(record.get("tokenizer_json"), str)):
        raise PlanError(f"checkpoint {where}: its recorded tokenizer {str(record)[:60]!r} is neither byte nor "
                        "hf: the checkpoint is damaged or was edited")
    try:
        return tokenizer_from_dict(record)
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(f"checkpoint {where}: its recorded tokenizer cannot be read ({type(exc).__name__}): "
                        "the checkpoint is damaged or was edited") from None
