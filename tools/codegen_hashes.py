"""Hash what the compiler generates for a set of zoo archs under a few plans: each chunk's
source, the manifest (less versions and file hashes) and the notes. Run it on two commits and
diff the output to show a refactor changed no generated code.

  PYTHONPATH=$PWD python -m tools.codegen_hashes [--archs a,b] [--plans "tp=2;pp=2,m=2"] > out.txt
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

ARCHS = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "opt", "bloom", "gpt_bigcode", "falcon_old",
         "gemma2", "phi3", "gptj", "mixtral", "deepseek_v3", "t5", "nn_encoder_seq_first", "hw_nanogpt",
         "hw_einsum", "hw_three_heads", "meta_llama", "rwkv"]
PLANS = ["tp=2", "pp=2,m=2", "dp=2"]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def one(arch: str, plan: str) -> str:
    import threefold
    from threefold.codegen.artifact import build_manifest, build_sources
    from threefold.compiler.api import compile_workload
    from tests.zoo import ZOO
    torch.manual_seed(1234)
    try:
        prog = compile_workload(ZOO[arch](), plan)
    except threefold.PlanError as exc:
        return f"planerror {_digest(str(exc))}"
    except Exception as exc:   # a crash is a result too: it must match as well
        return f"error {type(exc).__name__} {_digest(str(exc))}"
    sources = build_sources(prog)
    manifest = build_manifest(prog, sources, {}, with_weights=False).to_json()
    for k in ("threefold_version", "torch_version"):
        manifest.pop(k, None)
    parts = [f"{name}={_digest(text)}" for name, text in sorted(sources.items())]
    parts.append(f"manifest={_digest(json.dumps(manifest, sort_keys=True, default=str))}")
    parts.append(f"notes={_digest(json.dumps(list(prog.notes)))}")
    return " ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--plans", default=";".join(PLANS))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for arch in a.archs.split(","):
        for plan in a.plans.split(";"):
            print(f"{arch:24s} {plan:10s} {one(arch, plan)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
