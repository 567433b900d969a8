"""Save a compiled program as an artifact directory (see runtime/loader.py for the layout)."""
from __future__ import annotations

import hashlib
import json
import os

import torch

from threefold.codegen.python import content_hash, generate_module
from threefold.compiler.program import Program
from threefold.runtime.loader import BATCH_FILE, FORMAT, MANIFEST, Artifact, open_artifact
from threefold.runtime.mesh import stage_of
from threefold.runtime.shard import rank_state


def chunk_state(prog: Program, chunk, tp_rank: int) -> dict[str, torch.Tensor]:
    """The chunk's parameters and buffers for one tp rank, keyed by FQN."""
    return rank_state(prog.state, chunk.params + chunk.buffers, prog.shard_fns, tp_rank)


def build_sources(prog: Program) -> dict[str, str]:
    files = {}
    for chunk in prog.chunks:   # one module per chunk: the tp rank is a runtime value
        files[module_file(chunk.index)] = generate_module(prog, chunk)
    if prog.kernels:
        from threefold.codegen.triton import kernels_source
        # every region in program order, so a shared kernel's comment lists all it serves
        regions = [n.target for c in prog.chunks if c.gm is not None for n in c.gm.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "kernel_name", None) in prog.kernels]
        files["kernels.py"] = kernels_source(regions or list(prog.kernels.values()))
    debug_dir = os.environ.get("THREEFOLD_DEBUG_DIR")
    if debug_dir:  # every generated file, next to the per-pass program dumps
        os.makedirs(debug_dir, exist_ok=True)
        for name, text in files.items():
            with open(os.path.join(debug_dir, name), "w") as f:
                f.write(text)
    return files


def module_file(chunk: int) -> str:
    return f"chunk{chunk:02d}.py"


def save_artifact(prog: Program, out_dir: str, sources: dict[str, str] | None = None,
                  weights: bool = True, extra: dict | None = None,
                  batch: tuple | None = None, force: bool = False) -> Artifact:
    """Write manifest, sources and weight shards into out_dir (see threefold/outdir.py:
    built in a temporary sibling and renamed into place; a non-empty directory that is not
    one of ours is refused unless `force`, which moves it aside rather than deleting it).

    `batch` (the workload's global batch: model inputs, then target) is saved as
    batch.safetensors so `threefold run DIR` can train without the model's source. The
    manifest's "files" holds the sha256 of every file written (sources, weights, batch);
    the loader checks them before it imports or reads anything.
    """
    from threefold.outdir import write_out_dir
    sources = sources or build_sources(prog)

    def fill(tmp: str) -> None:
        hashes = {}
        for name, text in sources.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
            hashes[name] = hashlib.sha256(text.encode()).hexdigest()
        with_weights = weights and not prog.is_meta
        if with_weights:
            from safetensors.torch import save
            os.makedirs(os.path.join(tmp, "weights"))
            for chunk in prog.chunks:
                for r in range(prog.plan.tp):
                    state = {k: v.detach().to("cpu").contiguous().clone()
                             for k, v in chunk_state(prog, chunk, r).items()}
                    rel = f"weights/{_weights_file(chunk.index, r)}"
                    hashes[rel] = _write_bytes(os.path.join(tmp, rel), save(state))
        if batch is not None and with_weights:
            from safetensors.torch import save
            data = save({f"{i}": t.detach().to("cpu").contiguous() for i, t in enumerate(batch)})
            hashes[BATCH_FILE] = _write_bytes(os.path.join(tmp, BATCH_FILE), data)
        manifest = build_manifest(prog, sources, hashes, with_weights)
        if extra:
            manifest.update(extra)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)

    write_out_dir(out_dir, fill, kind="artifact", force=force)
    return open_artifact(out_dir)


def _write_bytes(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def _releasable(chunk) -> list[bool]:
    if chunk.gm is None:
        return [False] * len(chunk.outputs)
    nodes = {n.name: n for n in chunk.gm.graph.nodes}
    return [all(u.op == "output" for u in nodes[v].users) and nodes[v].op != "placeholder"
            for v in chunk.outputs]


def _weights_file(chunk: int, tp_rank: int) -> str:
    return f"chunk{chunk:02d}_tp{tp_rank}.safetensors"


def build_manifest(prog: Program, sources: dict[str, str], hashes: dict[str, str],
                   with_weights: bool) -> dict:
    import threefold
    plan = prog.plan
    by_name = {n.name: n for n in prog.graph.nodes}
    inputs = [n for n in prog.graph.nodes if n.op == "placeholder" and n.meta.get("tf", {}).get("kind") == "input"]

    def spec(node):
        val = node.meta["val"]
        return {"name": node.name, "shape": list(val.shape), "dtype": str(val.dtype).replace("torch.", ""),
                "placement": node.meta.get("tf", {}).get("placement", "R")}

    holders: dict[str, list[int]] = {}
    for c in prog.chunks:
        for fqn in c.params:
            holders.setdefault(fqn, []).append(c.index)
    chunks = []
    for c in prog.chunks:
        chunks.append({
            "index": c.index,
            "stage": stage_of(c.index, plan.pp),
            "class": f"Chunk{c.index}",
            "module": module_file(c.index),   # shared by every tp rank
            "weights": ({str(r): f"weights/{_weights_file(c.index, r)}" for r in range(plan.tp)}
                        if with_weights else {}),
            "inputs": [spec(by_name[v]) for v in c.inputs],
            "user_inputs": c.user_inputs,
            "outputs": [spec(by_name[v]) for v in c.outputs],
            # outputs no op of this chunk reads: their storage can be freed once sent
            "releasable": _releasable(c),
            "params": c.params,
            # parameters also held by other chunks (tied weights): their grads are summed
            "shared_params": {fqn: holders[fqn] for fqn in c.params if len(holders[fqn]) > 1},
            "hash": content_hash(sources[module_file(c.index)]),
        })
    return {
        "format": FORMAT,
        "threefold_version": threefold.__version__,
        "torch_version": torch.__version__,
        "model": prog.name,
        "plan": str(plan),
        "mesh": {"tp": plan.tp, "dp": plan.dp, "pp": plan.pp},
        "num_chunks": len(prog.chunks),
        "has_loss": prog.has_loss,
        "num_model_inputs": prog.num_model_inputs,
        "inputs": [spec(n) for n in inputs],
        "outputs": [{"shape": list(m.shape), "dtype": str(m.dtype).replace("torch.", "")} for m in prog.output_meta],
        "ties": prog.ties,
        "tp_grad_sync": list(prog.tp_grad_sync),
        # how each sharded parameter is cut per tp rank (runtime/shard.py)
        "shards": {fqn: spec.to_json() for fqn, spec in prog.shard_fns.items()},
        # full (unsharded) shape and dtype of every parameter and buffer: checkpoints/reshard
        "state_shapes": {fqn: [list(prog.state[fqn].shape), str(prog.state[fqn].dtype).replace("torch.", "")]
                         for c in prog.chunks for fqn in c.params + c.buffers},
        "scatter_gather": bool(plan.scatter_gather and plan.tp > 1),
        "schedule": {"kind": plan.schedule, "microbatches": plan.microbatches, "interleave": plan.interleave},
        "chunks": chunks,
        "files": hashes,
        "notes": prog.notes,
        # semantics the runtime keeps (passes/loss_form.py, passes/batch_dims.py, trace.py)
        "loss": prog.loss_form or {"mode": "whole", "denominator": {"kind": "const", "value": 1}},
        "batch_dims": prog.batch_dims,
        "output_batch_dims": prog.output_batch_dims,
        "frozen": sorted(n.meta["tf"]["fqn"] for n in prog.graph.nodes
                         if n.op == "placeholder" and n.meta.get("tf", {}).get("frozen")),
    }
