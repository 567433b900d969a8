"""`threefold.parallelize`: an unmodified model in, this rank's share of it out.

Every rank calls it (after the default process group exists, e.g. under torchrun or
`threefold.launch`). Each rank traces and compiles the whole model (deterministic, so all
ranks agree), generates the sources, loads only its own chunks and the weight shards cut
from the model's own weights, and wraps them in a `ParallelModule`.
"""
from __future__ import annotations

import functools
import os
import tempfile

import torch

from threefold.codegen.artifact import build_manifest, build_sources, chunk_state
from threefold.compiler.api import compile_workload
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.runtime.loader import import_file
from threefold.runtime.mesh import Mesh
from threefold.runtime.session import check_world, default_device, local_chunks, make_engine
from threefold.runtime.schedule import forward_only
from threefold.workload import Workload


class ParallelModule:
    """This rank's chunks of a parallelized model, with a training step."""

    def __init__(self, engine, plan: Plan, manifest: dict, program=None):
        self.engine = engine
        self.plan = plan
        self.manifest = manifest
        self.program = program

    def step(self, *inputs, target=None) -> float:
        """One iteration over the global batch: all microbatches forward and backward,
        gradients synchronised. Returns the mean loss, identical on every rank."""
        batch = tuple(inputs) + ((target,) if self.manifest["has_loss"] else ())
        if self.manifest["has_loss"] and target is None:
            raise PlanError("step() needs target=...: the model was compiled with a loss_fn")
        return self.engine.step(batch, train=True)

    def evaluate(self, *inputs, target=None) -> float:
        """Forward only (no gradients): the mean loss over the global batch."""
        batch = tuple(inputs) + ((target,) if self.manifest["has_loss"] else ())
        sched = forward_only(self.plan.pp, self.plan.microbatches, self.plan.interleave)
        with torch.no_grad():
            return self.engine.step(batch, train=False, schedule=sched)

    def forward(self, *inputs):
        """Forward-only inference: the model's outputs per microbatch on the last stage
        (concatenated along the batch), None on other stages."""
        sched = forward_only(self.plan.pp, self.plan.microbatches, self.plan.interleave)
        with torch.no_grad():
            self.engine.step(tuple(inputs), train=False, schedule=sched)
        outs = self.engine.last_outputs
        if not outs:
            return None
        return tuple(torch.cat(parts) for parts in zip(*outs))

    __call__ = forward

    def parameters(self):
        return self.engine.parameters()

    def named_parameters(self):
        return self.engine.named_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    @property
    def stats(self):
        return self.engine.stats


def parallelize(model=None, plan=None, example_inputs=None, loss_fn=None, *, target=None,
                device=None, workdir: str | None = None):
    """Compile `model` for `plan` and return this rank's `ParallelModule`.

    As a decorator on a model class or factory, `@parallelize(plan=..., example_inputs=...,
    loss_fn=..., target=...)`, calling the decorated thing builds the model and returns the
    ParallelModule.
    """
    if model is None or not isinstance(model, torch.nn.Module):
        factory = model
        def decorate(fn):
            @functools.wraps(fn)
            def build(*args, **kwargs):
                return parallelize(fn(*args, **kwargs), plan, example_inputs, loss_fn,
                                   target=target, device=device, workdir=workdir)
            return build
        return decorate(factory) if callable(factory) else decorate

    plan = Plan.parse(plan)
    if example_inputs is None:
        raise PlanError("parallelize needs example_inputs: a global batch of the model's inputs")
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    mesh = Mesh(tp=plan.tp, dp=plan.dp, pp=plan.pp)
    rank = check_world(mesh, str(plan))
    if any(p.is_meta for p in model.parameters()):
        raise PlanError(f"{type(model).__name__} is on the meta device: it can be compiled "
                        "(threefold compile) but training needs real weights; build it on a device")
    prog = compile_workload(Workload(model, example_inputs, target, loss_fn), plan)
    sources = build_sources(prog)
    manifest = build_manifest(prog, sources, {}, with_weights=False)
    root = workdir or tempfile.mkdtemp(prefix=f"threefold-rank{rank}-")
    os.makedirs(root, exist_ok=True)
    for name, text in sources.items():
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    dev = torch.device(device) if device is not None else default_device()
    coord = mesh.coord(rank)
    modules = {}
    for c in local_chunks(manifest, coord.pp):
        entry = manifest["chunks"][c]
        mod_file = os.path.join(root, entry["modules"][str(coord.tp)])
        cls = getattr(import_file(mod_file), entry["class"])
        module = cls(device=dev)
        module.load_state({k: v.to(dev) for k, v in chunk_state(prog, prog.chunks[c], coord.tp).items()})
        modules[c] = module
    engine = make_engine(manifest, modules, rank, dev)
    return ParallelModule(engine, plan, manifest, prog)
