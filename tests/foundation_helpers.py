"""Helpers for the foundation tests: build workloads, run compiled chunks in one process."""
from __future__ import annotations

import os
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workload(name: str, **kwargs) -> dict:
    """'gpt' (examples/gpt.py), 'gpt2' or 'llama' (examples/hf.py), with keyword sizes."""
    if name == "gpt":
        from examples.gpt import workload as make
    else:
        from examples import hf
        make = getattr(hf, name)
    return make(**kwargs)


def chunk_modules(prog) -> list:
    """Each chunk's generated module (tp rank 0), imported from source, weights from prog.state."""
    from threefold.codegen.artifact import build_sources, chunk_state, module_file
    from threefold.runtime.loader import import_file
    sources = build_sources(prog)
    tmp = tempfile.mkdtemp(prefix="threefold-test-")
    mods = []
    for chunk in prog.chunks:
        path = os.path.join(tmp, module_file(chunk.index))
        with open(path, "w") as f:
            f.write(sources[module_file(chunk.index)])
        mod = getattr(import_file(path), f"Chunk{chunk.index}")()
        mod.load_state(chunk_state(prog, chunk, 0))
        mods.append(mod)
    return mods


def run_in_order(mods, batch: tuple):
    """Run chunk modules one after another, as a pipeline would; returns the last outputs."""
    values: tuple = ()
    for mod in mods:
        values = mod(*values, *(batch[i] for i in mod.USER_INPUTS))
    return values


def summed_grads(mods) -> dict[str, torch.Tensor]:
    """Parameter gradients by FQN, summed over chunks that share a (tied) parameter."""
    grads: dict[str, torch.Tensor] = {}
    for mod in mods:
        for fqn, p in mod.named_parameters():
            if p.grad is not None:
                grads[fqn] = grads[fqn] + p.grad if fqn in grads else p.grad.clone()
    return grads


def canonical(prog) -> dict[str, str]:
    """Every parameter FQN (tied aliases included) -> the canonical FQN chunks use."""
    return {alias: fqn for fqn, aliases in prog.ties.items() for alias in aliases}


def unwrapped(source: str) -> str:
    """Generated code with line comments dropped and wrapped calls joined back onto one line
    (codegen wraps long calls after '(' and ', '), so tests can look for a whole statement."""
    import re
    code = "\n".join(line.split("  # ", 1)[0].rstrip() for line in source.splitlines())
    return re.sub(r",\n\s+", ", ", re.sub(r"\(\n\s+", "(", code))
