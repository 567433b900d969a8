"""The main job's configuration: one frozen `TrainConfig`, resolved defaults < file < command line.

The defaults are a TOML file inside the package (threefold/configs/default.toml), so
`threefold train` needs no file; `--config FILE` overrides any of them and every field has
a command-line flag (`--name-with-dashes`) that overrides both. The TOML groups fields in
sections ([run], [data], [model], [optim], [eval], [checkpoint], [sample]) for reading;
a field may also be written at the top level of a file. Bad keys, types and values are one-line
PlanErrors naming where the value came from.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from importlib import resources

from threefold.errors import PlanError

try:  # Python 3.11+
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as _toml  # type: ignore[no-redef]

SECTIONS = ("run", "data", "model", "optim", "eval", "checkpoint", "sample")
DTYPES = ("auto", "uint16", "uint32")      # token-id file element types (--data-dtype)


def _f(default, section: str, help: str):
    return field(default=default, metadata={"section": section, "help": help})


@dataclass(frozen=True)
class TrainConfig:
    # [run] what to train, where, and how to report
    spec: str | None = _f(None, "run", "workload path/to/file.py:factory (unset: the embedded GPT)")
    plan: str = _f("pp=2,m=4", "run", "parallel plan, e.g. 'tp=2,pp=2,dp=2,m=4'; m left out: 2*pp, dp left out: torchrun's ranks / (tp*pp), else 1")
    steps: int = _f(400, "run", "optimizer steps")
    seed: int = _f(0, "run", "seed for weights and batch order")
    out: str = _f("runs/train", "run", "directory for the loss curve, logs and summary")
    force: bool = _f(False, "run", "write --out even if it holds other files (moved aside)")
    json: bool = _f(False, "run", "print the summary as JSON")
    skip_nonfinite: bool = _f(False, "run", "skip a step with a non-finite loss or gradient")
    trace: bool = _f(False, "run", "record what every rank ran in the --trace-steps: OUT/trace.json (Chrome "
                     "trace-event format: Perfetto, chrome://tracing) and OUT/trace.html, with the measured "
                     "bubble next to the simulator's")
    trace_steps: str = _f("3", "run", "steps --trace records, 1-based, e.g. 3 or 3,5,7")
    weights: str | None = _f(None, "run", "start from a .safetensors file or Hugging Face directory: the model "
                             "is built on the meta device and each rank reads only its own slices")
    # [data] what the model reads
    data: str | None = _f(None, "data", "text file, directory of .txt, .jsonl ('text' field) or token-id .bin "
                          "(unset: the embedded corpus)")
    tokenizer: str = _f("byte", "data", "'byte' (256 ids) or a local Hugging Face tokenizer directory")
    data_dtype: str = _f("auto", "data", "element type of a token-id file: auto|uint16|uint32")
    val_fraction: float = _f(0.1, "data", "share of the tokens held out for validation (the tail)")
    batch: int = _f(16, "data", "global batch, sequences (split over dp ranks and microbatches)")
    seq: int = _f(64, "data", "tokens per sequence")
    # [model] the embedded GPT's shape (vocab size comes from the tokenizer)
    n_layer: int = _f(4, "model", "transformer blocks")
    n_head: int = _f(4, "model", "attention heads per block")
    n_embd: int = _f(64, "model", "hidden size")
    dropout: float = _f(0.0, "model", "dropout probability")
    # [optim] AdamW, warmup then cosine decay, global-norm clipping
    lr: float = _f(6e-3, "optim", "peak learning rate")
    min_lr: float = _f(6e-4, "optim", "learning rate at the end of the cosine decay")
    warmup: int = _f(20, "optim", "linear warmup steps")
    weight_decay: float = _f(0.1, "optim", "AdamW weight decay (matrices only)")
    decay_embeddings: bool = _f(False, "optim", "also decay embedding tables (default: matrices fed to "
                                "matmuls only)")
    betas: tuple[float, float] = _f((0.9, 0.95), "optim", "AdamW betas (command line: 0.9,0.95)")
    grad_clip: float = _f(1.0, "optim", "clip the global gradient norm to this (0: off)")
    # [eval] validation loss during training
    eval_every: int = _f(50, "eval", "validation loss every N steps and at the end (0: never)")
    eval_batches: int = _f(4, "eval", "validation batches per evaluation")
    # [checkpoint] sharded checkpoints
    save_every: int = _f(0, "checkpoint", "write a checkpoint every N steps (0: never)")
    ckpt_dir: str | None = _f(None, "checkpoint", "checkpoint directory (unset: OUT.ckpt)")
    resume: str | None = _f(None, "checkpoint", "resume from the newest checkpoint in this directory "
                            "('': ckpt_dir; unset: start fresh)")
    save_async: bool = _f(True, "checkpoint", "write checkpoints in the background: the step loop waits only "
                          "while this rank's state is copied to host memory (--no-save-async: wait for the write)")
    max_restarts: int = _f(0, "checkpoint", "when a rank dies or hangs, restart the job from the newest checkpoint "
                           "up to N times (needs --save-every)")
    min_world: int = _f(0, "checkpoint", "a restart may go on with fewer ranks, down to M, when the lost ones do "
                        "not come back (0: only the same world)")
    # [sample] text generated at the end of a language-model run
    sample_tokens: int = _f(200, "sample", "tokens to generate after training (0: none)")
    sample_prompt: str = _f("\n", "sample", "prompt the sample starts from")
    # Names of the fields a config file or the command line set (not TOML; for checks such as
    # "--seq means nothing for this SPEC").
    given: frozenset = field(default=frozenset(), compare=False, repr=False, metadata={"internal": True})

    def to_toml(self) -> str:
        return to_toml(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("internal")}
_TYPES = typing.get_type_hints(TrainConfig)


# ---- parsing and checking one value -------------------------------------------------------

def _kind(name: str) -> str:
    t = _TYPES[name]
    if t is bool:
        return "bool"
    if t is int:
        return "int"
    if t is float:
        return "float"
    if t is str:
        return "str"
    if typing.get_origin(t) is tuple:
        return "pair"
    return "optional str"   # str | None


_KIND_WORD = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
              "optional str": "a string", "pair": "two numbers, e.g. [0.9, 0.95]"}


def _coerce(name: str, value, where: str):
    """The value as the field's type, or a PlanError naming `where` it came from."""
    kind, raw = _kind(name), value
    ok = None
    if kind == "bool" and isinstance(value, bool):
        ok = value
    elif kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        ok = value
    elif kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        ok = float(value)
    elif kind in ("str", "optional str") and isinstance(value, str):
        ok = value
    elif kind == "optional str" and value is None:
        return None
    elif kind == "pair":
        if isinstance(value, str):   # the command line's form: "0.9,0.95"
            try:
                value = [float(v) for v in value.split(",")]
            except ValueError:
                value = None
        if (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            ok = (float(value[0]), float(value[1]))
    if ok is None:
        sep = " " if where.startswith("--") else " = "
        raise PlanError(f"{where}{sep}{_show(raw)} is invalid: {name} takes {_KIND_WORD[kind]}")
    return ok


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (str, list, tuple, bool)) or value is None else repr(value)


def _range_checks(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(field, reason and fix) for every value out of range."""
    bad = []

    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            bad.append((name, why))

    need(cfg.steps >= 1, "steps", "use 1 or more")
    need(math.isfinite(cfg.lr) and cfg.lr > 0, "lr", "use a positive finite learning rate")
    need(math.isfinite(cfg.min_lr) and 0 <= cfg.min_lr <= cfg.lr, "min_lr", f"use 0..lr ({cfg.lr})")
    need(cfg.warmup >= 0, "warmup", "use 0 or more steps")
    need(math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0, "weight_decay", "use 0 or more")
    need(all(0 <= b < 1 for b in cfg.betas), "betas", "use two numbers in [0, 1), e.g. 0.9,0.95")
    need(math.isfinite(cfg.grad_clip) and cfg.grad_clip >= 0, "grad_clip", "use 0 (off) or a positive norm")
    need(0 <= cfg.val_fraction < 1, "val_fraction", "use 0 (no validation) up to below 1, e.g. 0.1")
    need(cfg.eval_every >= 0, "eval_every", "use 0 (never) or a positive step count")
    need(1 <= cfg.eval_batches <= MAX_EVAL_BATCHES, "eval_batches", f"use 1..{MAX_EVAL_BATCHES}")
    need(0 <= cfg.seed < 2**32, "seed", "use 0..2**32-1 (4294967295)")
    need(cfg.save_every >= 0, "save_every", "use 0 (never) or a positive step count")
    need(cfg.max_restarts >= 0, "max_restarts", "use 0 (never restart) or more")
    need(cfg.max_restarts == 0 or cfg.save_every > 0, "max_restarts",
         "a restart resumes from a checkpoint: give --save-every N too")
    need(cfg.min_world >= 0, "min_world", "use 0 (same world only) or a number of ranks")
    need(cfg.sample_tokens >= 0, "sample_tokens", "use 0 (no sample) or more")
    need(cfg.sample_tokens == 0 or cfg.sample_prompt != "", "sample_prompt",
         "give at least one character to start the sample from, or --sample-tokens 0")
    need(cfg.data_dtype in DTYPES, "data_dtype", f"use one of {', '.join(DTYPES)}")
    need(1 <= cfg.batch <= EMBEDDED_MAX_BATCH, "batch", f"use 1..{EMBEDDED_MAX_BATCH} sequences")
    need(1 <= cfg.seq <= EMBEDDED_MAX_SEQ, "seq", f"use 1..{EMBEDDED_MAX_SEQ} tokens "
         "(the embedded GPT's position table)")
    need(1 <= cfg.n_layer <= MAX_LAYERS, "n_layer", f"use 1..{MAX_LAYERS} blocks")
    need(1 <= cfg.n_head <= MAX_EMBD, "n_head", f"use 1..{MAX_EMBD} heads")
    need(1 <= cfg.n_embd <= MAX_EMBD and cfg.n_embd % max(cfg.n_head, 1) == 0, "n_embd",
         f"use a positive multiple of n_head ({cfg.n_head}), at most {MAX_EMBD}")
    need(0 <= cfg.dropout < 1, "dropout", "use a probability in [0, 1)")
    need(cfg.tokenizer != "", "tokenizer", "use 'byte' or a tokenizer directory")
    need(bool(cfg.out.strip()), "out", "give a directory to write")
    need(_trace_steps_ok(cfg), "trace_steps", f"use step numbers 1..steps ({cfg.steps}), e.g. 3 or 3,5,7")
    return bad


def _trace_steps_ok(cfg: TrainConfig) -> bool:
    """--trace-steps parses, and with --trace every chosen step is one the run reaches."""
    from threefold.runtime.trace import parse_steps   # lazy: start-up: runtime.trace loads only on this path
    try:
        steps = parse_steps(cfg.trace_steps)
    except PlanError:
        return False
    return not cfg.trace or steps[-1] <= cfg.steps


# Fields only the embedded GPT job reads.
EMBEDDED_ONLY = ("data", "tokenizer", "data_dtype", "val_fraction", "n_layer", "n_head", "n_embd", "dropout")
EMBEDDED_MAX_SEQ = 1024     # the embedded GPT's position table limit (GPT-2's n_positions)
EMBEDDED_MAX_BATCH = 4096
MAX_EVAL_BATCHES = 10_000   # validation batches are built up front: bounded memory
MAX_LAYERS = 1024           # the embedded GPT's shape; its memory is checked against the machine too
MAX_EMBD = 65536


# ---- layers: defaults < file < command line ------------------------------------------------

def _flatten(table: dict, source: str) -> dict[str, tuple[object, str]]:
    """{field: (value, where)} from a parsed TOML table; unknown keys and sections are errors."""
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise PlanError(f"{source}: unknown section [{key}]{_suggest(key, SECTIONS)}; sections are "
                                f"{', '.join(SECTIONS)}")
            for sub, v in value.items():
                if sub not in FIELDS:
                    raise PlanError(f"{source}: unknown key {sub!r} in [{key}]{_suggest(sub, FIELDS)}")
                home = FIELDS[sub].metadata["section"]
                if home != key:
                    raise PlanError(f"{source}: {sub!r} belongs in [{home}], not [{key}]")
                out[sub] = (v, f"{source}: [{key}] {sub}")
        elif key in FIELDS:
            out[key] = (value, f"{source}: {key}")
        else:
            raise PlanError(f"{source}: unknown key {key!r}{_suggest(key, FIELDS)}")
    return out


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _read_toml(data: bytes, source: str) -> dict:
    try:
        return _toml.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise PlanError(f"{source} is not UTF-8 text: give a TOML file") from None
    except _toml.TOMLDecodeError as exc:
        raise PlanError(f"{source} is not valid TOML ({exc}): fix the file") from None
    except RecursionError:
        raise PlanError(f"{source} nests arrays or tables too deeply to read: a config is flat key = value "
                        "lines in [sections]") from None


def default_toml() -> bytes:
    """The embedded defaults (threefold/configs/default.toml)."""
    return (resources.files("threefold") / "configs" / "default.toml").read_bytes()


def load_config(path: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """The resolved configuration: embedded defaults, then the TOML file at `path`, then
    `overrides` ({field: value}, e.g. from the command line; None values are ignored)."""
    layers = [_flatten(_read_toml(default_toml(), "embedded default.toml"), "embedded default.toml")]
    if path is not None:
        if os.path.exists(path) and not os.path.isdir(path):
            # lazy: start-up: regular_file loads only on this path
            from threefold.regular_file import require_regular_file
            require_regular_file(path, f"--config {path!r}")    # a FIFO would block the read forever
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise PlanError(f"--config {path!r} does not exist: give a TOML file") from None
        except IsADirectoryError:
            raise PlanError(f"--config {path!r} is a directory: give a TOML file") from None
        except OSError as exc:
            raise PlanError(f"--config {path!r} cannot be read: {exc.strerror or exc}") from None
        layers.append(_flatten(_read_toml(data, path), path))
    cli = {}
    for name, value in (overrides or {}).items():
        if name not in FIELDS:
            raise PlanError(f"unknown setting {name!r}{_suggest(name, FIELDS)}")
        if value is not None:
            cli[name] = (value, f"--{name.replace('_', '-')}")
    layers.append(cli)
    values, where, given = {}, {}, set()
    for i, layer in enumerate(layers):
        for name, (value, src) in layer.items():
            values[name] = _coerce(name, value, src)
            where[name] = src
            if i > 0:
                given.add(name)
    cfg = TrainConfig(**values, given=frozenset(given))
    if cfg.spec is not None:   # a SPEC builds its own model and batches
        for name in EMBEDDED_ONLY:
            if name in given:
                sep = " " if where[name].startswith("--") else " = "
                raise PlanError(f"{where[name]}{sep}{_show(getattr(cfg, name))} means nothing for SPEC "
                                f"{cfg.spec!r} (it builds its own model and data): drop it, or train the "
                                "embedded GPT (no SPEC)")
    for name, why in _range_checks(cfg):
        src = where.get(name, f"default {name}")
        sep = " " if src.startswith("--") else " = "     # "--lr -1.0" / "FILE: [optim] lr = -1.0"
        raise PlanError(f"{src}{sep}{_show(getattr(cfg, name))} is invalid: {why}")
    return cfg


# ---- TOML out ---------------------------------------------------------------------------

def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)   # a TOML basic string: JSON's escapes are TOML's


HEADER = ("# The embedded defaults of `threefold train` (threefold/config.py reads this first).\n"
          "# Copy it, change what you need, and pass it with --config FILE; any flag overrides it.\n"
          "# Regenerate after changing TrainConfig: python -m threefold.config > threefold/configs/default.toml\n\n")


def to_toml(cfg: TrainConfig) -> str:
    """The resolved values as TOML that load_config reads back to the same config; unset
    optional fields are comments."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name, f in FIELDS.items():
            if f.metadata["section"] != section:
                continue
            value = getattr(cfg, name)
            text = f"# {name} =" if value is None else f"{name} = {_toml_value(value)}"
            lines.append(f"{text:<28} # {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------

_METAVARS = {"data": "PATH", "weights": "PATH", "tokenizer": "byte|DIR", "out": "DIR", "ckpt_dir": "DIR", "plan": "PLAN", "trace_steps": "N[,N...]",
             "data_dtype": "|".join(DTYPES)}

_ALIASES = {"save_every": ("--ckpt-every",)}    # other spellings of a flag


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("spec",)) -> None:
    """`--config`, `--print-config` and one flag per field (default None: 'not given', so
    the file and the embedded defaults show through)."""
    defaults = TrainConfig()
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML file of settings (defaults < file < flags); see --print-config")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved settings as TOML and exit")
    for name, f in FIELDS.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        help = f.metadata["help"] + (f" (default {_toml_value(default)})" if default is not None else "")
        kind = _kind(name)
        if kind == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help)
        elif name == "resume":
            parser.add_argument(flag, dest=name, nargs="?", const="", default=None, metavar="DIR", help=help)
        else:
            typ = {"int": int, "float": float}.get(kind, str)
            metavar = _METAVARS.get(name) or {"int": "N", "float": "X", "pair": "B1,B2"}.get(kind, "TEXT")
            parser.add_argument(flag, *_ALIASES.get(name, ()), dest=name, type=typ, default=None, metavar=metavar,
                                help=help)


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config a parsed command line asks for (flags given override --config's file)."""
    overrides = {name: getattr(args, name) for name in FIELDS if getattr(args, name, None) is not None}
    return load_config(getattr(args, "config", None), overrides)


if __name__ == "__main__":   # the embedded default.toml, from the dataclass defaults
    print(HEADER + to_toml(TrainConfig()), end="")
