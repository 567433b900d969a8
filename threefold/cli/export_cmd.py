"""`threefold export CKPT --out DIR [--hf-config CFG] [--max-shard-size 5GB]`: a checkpoint as safetensors."""
from __future__ import annotations

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint (any plan) as consolidated safetensors",
        description="Read a checkpoint written by threefold.save (any plan) into full tensors and "
        "write DIR/model.safetensors (past --max-shard-size: Hugging Face's sharded files with "
        "model.safetensors.index.json). With --hf-config (a Hugging Face directory with config.json) "
        "the tensors get the transformers model's names and config.json is written too, so "
        "from_pretrained(DIR) loads it. A checkpoint of threefold train's embedded GPT is always "
        "written as a GPT-2 (config.json included; a given --hf-config must be a GPT-2 config of "
        "the same shape with activation_function=gelu). With --adapters (a LoRA fine-tune of a PEFT "
        "model) only the adapter is written, in PEFT's format (adapter_config.json and "
        "adapter_model.safetensors), which peft.PeftModel.from_pretrained(base, DIR) loads.")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory (a step_* dir, or a root: its newest)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--hf-config", default=None, help="Hugging Face config directory (config.json)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors file (e.g. 5GB, 500MB, 2GiB); more is written as numbered "
                   "files with an index (default: 5GB, as transformers)")
    p.add_argument("--adapters", action="store_true",
                   help="write only the LoRA adapter, in PEFT's format (needs --peft-config)")
    p.add_argument("--peft-config", default=None, metavar="CFG",
                   help="with --adapters: the LoRA config the model was built with (adapter_config.json "
                   "or a directory holding it); written unchanged")
    p.add_argument("--adapter-name", default="default",
                   help="with --adapters: the adapter's name in the model (default: default)")
    p.add_argument("--force", action="store_true", help="write --out even if it holds other files")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.adapters:
        if args.hf_config is not None:
            raise PlanError("--hf-config names a full model's tensors; --adapters writes the adapter only: drop one")
        # lazy: start-up: a command loads checkpoint.peft_export only when it runs
        from threefold.checkpoint.peft_export import export_adapters
        summary = export_adapters(args.ckpt, args.out, args.peft_config, args.adapter_name, args.force)
        return _print(args, summary)
    if args.peft_config is not None:
        raise PlanError("--peft-config is for --adapters (a LoRA adapter in PEFT's format): add --adapters")
    # lazy: start-up: a command loads checkpoint.export only when it runs
    from threefold.checkpoint.export import export
    # lazy: start-up: a command loads cli.generate_cmd only when it runs
    from threefold.cli.generate_cmd import read_generate_info
    # a checkpoint of threefold train's embedded GPT records its config: written as a GPT-2
    summary = export(args.ckpt, args.out, args.hf_config, args.force, args.max_shard_size,
                     run_record=read_generate_info)
    return _print(args, summary)


def _print(args, summary: dict) -> int:
    if args.json:
        print(dumps(summary))
    else:
        print(f"exported {summary['tensors']} tensors ({summary['bytes'] / 2**20:.1f} MB) from "
              f"{summary['checkpoint']} to {summary['out']} ({', '.join(summary['files'][:3])}"
              f"{' ...' if len(summary['files']) > 3 else ''})")
    return 0
