"""`threefold generate CKPT --prompt TEXT`: text from a checkpoint `threefold train` saved.

The checkpoint (any plan) is read back into full tensors in this one process
(checkpoint/export.py `consolidate`); the model and tokenizer are rebuilt from what the run
recorded in the checkpoint (`extra["generate"]`: the embedded GPT's config and tokenizer, or
the SPEC), and the prompt is extended greedily (--temperature 0) or by seeded sampling.
"""
from __future__ import annotations

import math

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError


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
    p.add_argument("--spec", default=None, help="rebuild the model from this SPEC instead of the recorded one")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: OMP_NUM_THREADS, else 1 for a model under 100M parameters, "
                   "whose small matmuls run slower split across threads, else one per core)")
    p.add_argument("--json", action="store_true", help="print {prompt, text, tokens} as JSON")
    p.set_defaults(func=run)


def read_generate_info(ckpt: str) -> dict:
    """The run's `extra["generate"]` record from the checkpoint's metadata ({} if none)."""
    import torch.distributed.checkpoint as dcp
    from threefold.checkpoint.collective import quiet
    from threefold.checkpoint.safe_read import SafeLoadPlanner, SafeReader, unwrapped
    from threefold.checkpoint.state import META
    sd = {META: None}
    try:
        with quiet(1), unwrapped():
            dcp.load(sd, storage_reader=SafeReader(ckpt), planner=SafeLoadPlanner(), no_dist=True)
    except PlanError:      # a refused class (checkpoint/safe_read.py): never read past
        raise
    except Exception:
        return {}
    meta = sd.get(META) or {}
    extra = meta.get("extra") or {}
    return extra.get("generate") or {}


def build_model(info: dict, spec: str | None):
    """(model, tokenizer, context) from the recorded run (or --spec)."""
    spec = spec or info.get("spec")
    if "gpt" in info and spec is None:
        import torch
        from threefold.dataset import tokenizer_from_dict
        from threefold.models.gpt import GPT, GPTConfig
        with torch.device("cpu"):
            model = GPT(GPTConfig(**info["gpt"]))
        return model, tokenizer_from_dict(info["tokenizer"]), int(info.get("context") or info["gpt"]["block_size"])
    if spec is None:
        raise PlanError("the checkpoint does not say which model it holds (saved by threefold.save outside "
                        "threefold train): give --spec SPEC")
    from threefold.workload import load_spec
    w = load_spec(spec, info.get("sizes") if spec == info.get("spec") else None)
    if w.tokenizer is None:
        raise PlanError(f"SPEC {spec!r} gives no tokenizer: add 'tokenizer' (encode/decode) to its dict "
                        "to generate text")
    context = info.get("context") or (int(w.inputs[0].shape[-1]) if hasattr(w.inputs[0], "shape") else 1024)
    return w.model, w.tokenizer, int(context)


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4
MAX_TOKENS = 1_000_000


SMALL_MODEL_PARAMS = 100_000_000   # below it, one token's matmuls are too small to share out


def generate_threads(given: int | None, params: int) -> int:
    """Threads for sampling: --threads, else OMP_NUM_THREADS, else 1 for a small model (torch's
    default of one per core made a tiny model's generate 5x slower: per-op thread start-up
    outweighs the work), else one per core."""
    import os
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
    from threefold.checkpoint.export import consolidate
    from threefold.train.generate import load_into, sample
    ckpt, full = consolidate(args.ckpt)
    model, tokenizer, context = build_model(read_generate_info(ckpt), args.spec)
    load_into(model, full)
    import torch
    torch.set_num_threads(generate_threads(args.threads, sum(p.numel() for p in model.parameters())))
    prompt = tokenizer.encode(args.prompt)
    ids = sample(model, prompt, args.tokens, context, args.temperature, args.top_k, args.seed)
    text = tokenizer.decode(ids[len(prompt):])
    if args.json:
        print(dumps({"checkpoint": ckpt, "prompt": args.prompt, "text": text, "tokens": len(ids) - len(prompt)}))
    else:
        from threefold.cli.train_cmd import printable
        print(printable(args.prompt + text))
    return 0
