"""`threefold export CKPT --out DIR [--hf-config CFG] [--max-shard-size 5GB]`: a checkpoint as safetensors."""
from __future__ import annotations

from threefold.cli.jsonout import dumps


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint (any plan) as consolidated safetensors",
        description="Read a checkpoint written by threefold.save (any plan) into full tensors and "
        "write DIR/model.safetensors (past --max-shard-size: Hugging Face's sharded files with "
        "model.safetensors.index.json). With --hf-config (a Hugging Face directory with config.json) "
        "the tensors get the transformers model's names and config.json is written too, so "
        "from_pretrained(DIR) loads it. A checkpoint of threefold train's embedded GPT is always "
        "written as a GPT-2 (config.json included; a given --hf-config must be a GPT-2 config of "
        "the same shape with activation_function=gelu).")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory (a step_* dir, or a root: its newest)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--hf-config", default=None, help="Hugging Face config directory (config.json)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors file (e.g. 5GB, 500MB, 2GiB); more is written as numbered "
                   "files with an index (default: 5GB, as transformers)")
    p.add_argument("--force", action="store_true", help="write --out even if it holds other files")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from threefold.checkpoint.export import export
    from threefold.cli.generate_cmd import read_generate_info
    # a checkpoint of threefold train's embedded GPT records its config: written as a GPT-2
    summary = export(args.ckpt, args.out, args.hf_config, args.force, args.max_shard_size,
                     run_record=read_generate_info)
    if args.json:
        print(dumps(summary))
    else:
        print(f"exported {summary['tensors']} tensors ({summary['bytes'] / 2**20:.1f} MB) from "
              f"{summary['checkpoint']} to {summary['out']} ({', '.join(summary['files'][:3])}"
              f"{' ...' if len(summary['files']) > 3 else ''})")
    return 0
