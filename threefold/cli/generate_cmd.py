"""`threefold generate CKPT --prompt TEXT`: text from a checkpoint `threefold train` saved.

The checkpoint (any plan) is read back into full tensors in this one process
(checkpoint/export.py `consolidate`); the model and tokenizer are rebuilt from what the run
recorded in the checkpoint (`extra["generate"]`), and the prompt is extended greedily
(--temperature 0) or by seeded sampling.

A checkpoint is data and never chooses code: the embedded GPT is rebuilt from its recorded
config (numbers, checked against the saved tensors' shapes before anything is allocated);
a recorded SPEC is only shown as a hint. The model comes from the user's --spec, or from the
recorded SPEC when it is a file path outside the checkpoint folder and the user confirms it
with --trust-recorded-spec (the checkpoint then names code the user already has; a
`module:callable(args)` SPEC or a file shipped inside the checkpoint is never run from it).
"""
from __future__ import annotations

import math
import os

import torch

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.workload import load_spec


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="sample text from a checkpoint saved by threefold train",
        description="Read a checkpoint written by `threefold train --save-every N` (any plan) into "
        "one process, rebuild its model and tokenizer, and continue --prompt by --tokens tokens.")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory (a step_* dir, or a root: its newest)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample only from the k likeliest tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--spec", default=None, help="rebuild the model from this SPEC (a recorded SPEC is only a hint)")
    p.add_argument("--trust-recorded-spec", action="store_true",
                   help="rebuild the model from the SPEC the checkpoint records, if it is a .py file "
                   "outside the checkpoint folder (never a module:callable or a file inside it)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: OMP_NUM_THREADS, else 1 for a model under 100M parameters, "
                   "whose small matmuls run slower split across threads, else one per core)")
    p.add_argument("--json", action="store_true", help="print {prompt, text, tokens} as JSON")
    p.set_defaults(func=run)


def read_generate_info(ckpt: str) -> dict:
    """The run's `extra["generate"]` record from the checkpoint's metadata ({} if none),
    read and checked by the one validating reader (checkpoint/reader.py)."""
    # lazy: start-up: a command loads checkpoint.reader only when it runs
    from threefold.checkpoint.reader import read_checkpoint
    return read_checkpoint(ckpt).generate


def build_model(info: dict, spec: str | None, trust_recorded: bool = False, ckpt: str | None = None,
                shapes: dict | None = None):
    """(model, tokenizer, context) from --spec, the recorded embedded GPT, or (confirmed by
    --trust-recorded-spec) the recorded file SPEC. `shapes` (FQN -> shape of the saved
    tensors) bounds the recorded GPT config before it is built."""
    recorded = info.get("spec")
    if spec is None and recorded is None and "gpt" in info:
        # lazy: start-up: a command loads checkpoint.run_record only when it runs
        from threefold.checkpoint.run_record import gpt_config, tokenizer_record
        from threefold.models.gpt import GPT   # lazy: start-up: a command loads models.gpt only when it runs
        cfg = gpt_config(info["gpt"], shapes, ckpt or "the checkpoint")
        tokenizer = tokenizer_record(info.get("tokenizer"), ckpt or "the checkpoint")
        with torch.device("cpu"):
            model = GPT(cfg)
        return model, tokenizer, int(info.get("context") or cfg.block_size)
    if spec is None and recorded is not None:
        spec = _recorded_spec(recorded, trust_recorded, ckpt)
    if spec is None:
        raise PlanError("the checkpoint does not say which model it holds (saved by threefold.save outside "
                        "threefold train): give --spec SPEC")
    # lazy: start-up: a command loads train.source only when it runs
    from threefold.train.source import _absolute_spec
    same = recorded is not None and _absolute_spec(spec) == recorded
    w = load_spec(spec, info.get("sizes") if same else None)
    if w.tokenizer is None:
        raise PlanError(f"SPEC {spec!r} gives no tokenizer: add 'tokenizer' (encode/decode) to its dict "
                        "to generate text")
    context = (info.get("context") if same else None) or (
        int(w.inputs[0].shape[-1]) if hasattr(w.inputs[0], "shape") else 1024)
    return w.model, w.tokenizer, int(context)


def _recorded_spec(recorded: str, trust: bool, ckpt: str | None) -> str:
    """The recorded SPEC, where the user confirmed it and it names a file they have; else
    the one-line refusal that shows it as a hint."""
    # lazy: start-up: a command loads checkpoint.run_record only when it runs
    from threefold.checkpoint.run_record import is_file_spec
    where = ckpt or "the checkpoint"
    if not trust:
        raise PlanError(f"checkpoint {where} records SPEC {recorded!r} (a hint: a checkpoint never chooses "
                        "the code that runs): pass --spec SPEC, or --trust-recorded-spec if that file is yours")
    if not is_file_spec(recorded):
        raise PlanError(f"checkpoint {where} records SPEC {recorded!r}, a module:callable, which "
                        "--trust-recorded-spec never runs: pass it as --spec if you mean to run it")
    path = os.path.realpath(recorded.rpartition(":")[0])
    folder = os.path.realpath(os.path.dirname(os.path.abspath(ckpt))) if ckpt else None
    if folder is not None and (path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)):
        raise PlanError(f"checkpoint {where} records SPEC {recorded!r}, a file inside the checkpoint folder, "
                        "which is never run from it: pass --spec with a copy you have checked")
    return recorded


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4
MAX_TOKENS = 1_000_000


SMALL_MODEL_PARAMS = 100_000_000   # below it, one token's matmuls are too small to share out


def generate_threads(given: int | None, params: int) -> int:
    """Threads for sampling: --threads, else OMP_NUM_THREADS, else 1 for a small model (torch's
    default of one per core made a tiny model's generate 5x slower: per-op thread start-up
    outweighs the work), else one per core."""
    if given is not None:
        if given < 1:
            raise PlanError(f"--threads {given} is invalid: use 1 or more")
        return given
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return 1 if params < SMALL_MODEL_PARAMS else max(1, os.cpu_count() or 1)


def run(args) -> int:
    if args.tokens < 0:
        raise PlanError(f"--tokens {args.tokens} is invalid: use 0 or more")
    if not math.isfinite(args.temperature) or not (args.temperature == 0 or
                                                   MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE):
        raise PlanError(f"--temperature {args.temperature} is invalid: use 0 (greedy) or {MIN_TEMPERATURE:g} to "
                        f"{MAX_TEMPERATURE:g} (logits divided by less overflow)")
    if not 0 <= args.seed < 2**63:
        raise PlanError(f"--seed {args.seed} is invalid: use 0..2**63-1")
    if args.tokens > MAX_TOKENS:
        raise PlanError(f"--tokens {args.tokens} is invalid: use at most {MAX_TOKENS}")
    if args.top_k is not None and args.top_k < 1:
        raise PlanError(f"--top-k {args.top_k} is invalid: use 1 or more")
    # lazy: start-up: a command loads checkpoint.export only when it runs
    from threefold.checkpoint.export import consolidate
    # lazy: start-up: a command loads train.generate only when it runs
    from threefold.train.generate import load_into, sample
    ckpt, full = consolidate(args.ckpt)
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    model, tokenizer, context = build_model(read_generate_info(ckpt), args.spec, args.trust_recorded_spec,
                                            ckpt, shapes)
    load_into(model, full)
    torch.set_num_threads(generate_threads(args.threads, sum(p.numel() for p in model.parameters())))
    prompt = tokenizer.encode(args.prompt)
    ids = sample(model, prompt, args.tokens, context, args.temperature, args.top_k, args.seed)
    text = tokenizer.decode(ids[len(prompt):])
    if args.json:
        print(dumps({"checkpoint": ckpt, "prompt": args.prompt, "text": text, "tokens": len(ids) - len(prompt)}))
    else:
        # lazy: start-up: a command loads cli.train_cmd only when it runs
        from threefold.cli.train_cmd import printable
        print(printable(args.prompt + text))
    return 0
