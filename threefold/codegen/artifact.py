"""Save a compiled program as an artifact directory (see runtime/loader.py for the layout)."""
from __future__ import annotations

import hashlib
import importlib.util
import os

import torch

from threefold.codegen.model_outputs import missing_reason
from threefold.codegen.op_modules import op_modules
from threefold.codegen.python import content_hash, generate_module
from threefold.compiler.model_flops import graph_model_flops
from threefold.compiler.param_roles import graph_roles
from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ir.stages import Program
from threefold.runtime.loader import BATCH_FILE, MANIFEST, Artifact, open_artifact
from threefold.runtime.manifest import ChunkEntry, LossForm, Manifest, TensorSpec
from threefold.runtime.mesh import chunk_layout, stage_of
from threefold.runtime.shard import rank_state
from threefold.placement import on_mesh_of, parse as parse_placement


def chunk_state(prog: Program, chunk, tp_rank: int) -> dict[str, torch.Tensor]:
    """The chunk's parameters and buffers for one tp rank, keyed by FQN."""
    return rank_state(prog.state, chunk.params + chunk.buffers, prog.shard_fns, tp_rank)


def build_sources(prog: Program) -> dict[str, str]:
    files = {}
    for chunk in prog.chunks:   # one module per chunk: the tp rank is a runtime value
        files[module_file(chunk.index)] = generate_module(prog, chunk)
    if prog.kernels:
        if importlib.util.find_spec("triton") is None:   # (a base install leaves it out: CPU)
            raise PlanError("fuse=true needs Triton, which is not installed: pip install 'threefold[gpu]' "
                            "(or triton), or set fuse=false")
        # lazy: start-up: codegen.triton loads only on this path
        from threefold.codegen.triton import kernels_source
        # every region in program order, so a shared kernel's comment lists all it serves
        regions = [n.target for c in prog.chunks for n in c.gm.graph.nodes
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
                  batch: tuple | None = None, force: bool = False, sign_key: bytes | None = None) -> Artifact:
    """Write manifest, sources and weight shards into out_dir (see threefold/outdir.py:
    built in a temporary sibling and renamed into place; a non-empty directory that is not
    one of ours is refused unless `force`, which moves it aside rather than deleting it).

    `batch` (the workload's global batch: model inputs, then target) is saved as
    batch.safetensors so `threefold run DIR` can train without the model's source. The
    manifest's "files" holds the sha256 of every file written (sources, weights, batch);
    the loader checks them before it imports or reads anything. With `sign_key`, an
    HMAC-SHA256 of the manifest is written beside it (runtime/signing.py).
    """
    from threefold.outdir import write_out_dir   # lazy: start-up: outdir loads only on this path
    sources = sources or build_sources(prog)

    def fill(tmp: str) -> None:
        hashes = {}
        for name, text in sources.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
            hashes[name] = hashlib.sha256(text.encode()).hexdigest()
        with_weights = weights and not prog.is_meta
        if with_weights:
            # lazy: safetensors loads only when weight files are read or written
            from safetensors.torch import save
            os.makedirs(os.path.join(tmp, "weights"))
            for chunk in prog.chunks:
                for r in range(prog.plan.tp):
                    state = {k: v.detach().to("cpu").contiguous().clone()
                             for k, v in chunk_state(prog, chunk, r).items()}
                    rel = f"weights/{_weights_file(chunk.index, r)}"
                    hashes[rel] = _write_bytes(os.path.join(tmp, rel), save(state))
        if batch is not None and with_weights:
            # lazy: safetensors loads only when weight files are read or written
            from safetensors.torch import save
            data = save({f"{i}": t.detach().to("cpu").contiguous() for i, t in enumerate(batch)})
            hashes[BATCH_FILE] = _write_bytes(os.path.join(tmp, BATCH_FILE), data)
        manifest = build_manifest(prog, sources, hashes, with_weights)
        if extra:
            manifest = manifest.replace(extra={**manifest.extra, **extra})
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            f.write(manifest.dumps())
        if sign_key is not None:
            # lazy: start-up: runtime.signing loads only on this path
            from threefold.runtime.signing import sign
            sign(tmp, sign_key, MANIFEST)

    write_out_dir(out_dir, fill, kind="artifact", force=force)
    return open_artifact(out_dir)


def _write_bytes(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def _releasable(chunk) -> list[bool]:
    nodes = {n.name: n for n in chunk.gm.graph.nodes}
    return [all(u.op == "output" for u in nodes[v].users) and nodes[v].op != "placeholder"
            for v in chunk.output_names]


def _weights_file(chunk: int, tp_rank: int) -> str:
    return f"chunk{chunk:02d}_tp{tp_rank}.safetensors"


def build_manifest(prog: Program, sources: dict[str, str], hashes: dict[str, str],
                   with_weights: bool) -> Manifest:
    """The typed manifest of a compiled program (runtime/manifest.py): what any rank needs
    to assemble itself, with the sha256 `hashes` of the files written beside it."""
    import threefold
    plan = prog.plan

    def spec(b) -> TensorSpec:   # a stages.BoundarySpec, as the manifest writes it
        return TensorSpec(b.name, b.shape, _dtype(b.dtype), parse_placement(b.placement), tuple(b.axes))

    holders: dict[str, list[int]] = {}
    for c in prog.chunks:
        for fqn in c.params:
            holders.setdefault(fqn, []).append(c.index)
    chunks = tuple(ChunkEntry(
        index=c.index,
        stage=stage_of(c.index, plan.pp, chunk_layout(plan.schedule)),
        cls=f"Chunk{c.index}",
        module=module_file(c.index),   # shared by every tp rank
        weights=({r: f"weights/{_weights_file(c.index, r)}" for r in range(plan.tp)} if with_weights else {}),
        inputs=tuple(spec(b) for b in c.inputs),
        user_inputs=tuple(c.user_inputs),
        outputs=tuple(spec(b) for b in c.outputs),
        # outputs no op of this chunk reads: their storage can be freed once sent
        releasable=tuple(_releasable(c)),
        params=tuple(c.params),
        # parameters also held by other chunks (tied weights): their grads are summed
        shared_params={fqn: tuple(holders[fqn]) for fqn in c.params if len(holders[fqn]) > 1},
        hash=content_hash(sources[module_file(c.index)]),
        units=tuple((u.name, tuple(u.params)) for u in c.units),
        flops=_chunk_flops(c),
    ) for c in prog.chunks)
    return Manifest(
        plan=plan,
        chunks=chunks,
        has_loss=prog.has_loss,
        num_model_inputs=prog.num_model_inputs,
        model=prog.name,
        inputs=tuple(spec(b) for b in prog.user_inputs),
        outputs=tuple({"shape": list(m.shape), "dtype": _dtype(m.dtype)} for m in prog.output_meta),
        ties=prog.ties,
        tp_grad_sync=tuple(prog.tp_grad_sync),
        # how each sharded parameter is cut per tp rank (runtime/shard.py)
        shards=dict(prog.shard_fns),
        # full (unsharded) shape and dtype of every parameter and buffer: checkpoints/reshard
        state_shapes={fqn: (list(prog.state[fqn].shape), _dtype(prog.state[fqn].dtype))
                      for c in prog.chunks for fqn in c.params + c.buffers},
        local_shapes=_local_shapes(prog),
        # what the training loop reads, decided here (weight decay, model FLOP/s)
        param_roles=graph_roles(prog),
        model_flops=int(graph_model_flops(prog)),
        # semantics the runtime keeps (passes/loss_form.py, passes/batch_dims.py, trace.py)
        loss=LossForm.from_json(prog.loss_form),
        batch_dims=prog.batch_dims,
        output_batch_dims=prog.output_batch_dims,
        output_tree=prog.output_tree,
        model_outputs_missing=missing_reason(prog),
        seq_length=prog.seq_len * plan.cp - prog.seq_tail if plan.cp > 1 and prog.seq_len else None,
        op_modules=op_modules(prog),
        experts={f: e for c in prog.chunks for r in c.experts for f, e in r["params"].items()},
        expert_modules={f: [e, g["experts"]] for c in prog.chunks for g in c.module_experts
                        for f, e in g["owned"].items()},
        param_placements=_param_placements(prog),
        frozen=tuple(sorted({tf(n)["fqn"] for _, n in prog.chunk_nodes()
                             if n.op == "placeholder" and tf(n).get("frozen")})),
        notes=tuple(prog.notes),
        files=dict(hashes),
        threefold_version=threefold.__version__,
        torch_version=torch.__version__,
    )


def _param_placements(prog) -> dict:
    """FQN -> its placement on the mesh (threefold/placement.OnMesh), for every parameter the
    passes placed on some axis (a tied one: where it is first held)."""
    out = {}
    for _, n in prog.chunk_nodes():
        if n.op == "placeholder" and tf(n).get("kind") == "param" and tf(n)["fqn"] not in out:
            on = on_mesh_of(n)
            if on.items:
                out[tf(n)["fqn"]] = on
    return out


def _chunk_flops(chunk) -> tuple[int, int, int]:
    cost = chunk.cost
    if cost is None:
        return (0, 0, 0)
    b, w = cost.backward_flops
    return (int(cost.flops), int(b), int(w))


def _local_shapes(prog: Program) -> dict[str, list[int]]:
    """Every parameter's shape on one tp rank (its placeholders' shapes in the chunk graphs)."""
    out: dict[str, list[int]] = {}
    for _, n in prog.chunk_nodes():
        if n.op == "placeholder" and tf(n).get("kind") == "param":
            out.setdefault(tf(n)["fqn"], [int(x) for x in n.meta["val"].shape])
    ep = getattr(prog.plan, "ep", 1)
    for c in prog.chunks:   # under ep=N a rank holds E/N of each expert weight's rows
        for r in c.experts:
            for fqn, experts in r["params"].items():
                out[fqn] = [experts // ep] + out[fqn][1:]
    return out


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
