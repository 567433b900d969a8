"""Faults for the dry-run tests: a wrong collective injected into one rank's generated
program (tests/test_dry_run.py), and the rank functions that run the same program on real
gloo ranks with every collective recorded at the same layer as the dry run."""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

# the first forward all-reduce of a row-parallel output (tp_ops.g) in a generated chunk
_FIRST_G = re.compile(r"tp_ops\.g\((\w+), self\.tp_group\)")


def shape_changed(src: str) -> str:
    """The first tp all-reduce carries one more column (then drops it): same math, wrong shape."""
    return _FIRST_G.sub(r"tp_ops.g(torch.cat([\1, \1[..., :1]], -1), self.tp_group)[..., :-1]", src, count=1)


def dropped(src: str) -> str:
    """The first tp all-reduce is not issued."""
    return _FIRST_G.sub(r"\1", src, count=1)


TRANSFORMS = {"shape": shape_changed, "drop": dropped}


class FaultySource:
    """A rank source whose chunk classes, on rank `target` only, come from transformed
    generated sources (the other ranks get the program as compiled)."""

    def __init__(self, base, sources: dict[str, str], target: int, transform):
        self.base, self.sources, self.target, self.transform = base, sources, target, transform
        self._classes: dict = {}

    def chunk_class(self, entry):
        if dist.get_rank() != self.target:
            return self.base.chunk_class(entry)
        if entry.module not in self._classes:
            from threefold.runtime.loader import import_source
            text = self.transform(self.sources[entry.module])
            assert text != self.sources[entry.module], "the fault found nothing to change"
            self._classes[entry.module] = getattr(import_source(text, f"<faulty-{self.target}>/{entry.module}"),
                                                  entry.cls)
        return self._classes[entry.module]

    def load_weights(self, module, entry, tp_rank, device):
        return self.base.load_weights(module, entry, tp_rank, device)


class RandomWeights:
    """Real tensors for a real run: each parameter drawn from a seeded normal (the same on
    every rank), so the step's control flow is a real one."""

    def __init__(self, sources: dict[str, str]):
        from threefold.runtime.dry_run import DrySource
        self.classes = DrySource(sources, "<real-run>")

    def chunk_class(self, entry):
        return self.classes.chunk_class(entry)

    def load_weights(self, module, entry, tp_rank, device):
        g = torch.Generator().manual_seed(entry.index if hasattr(entry, "index") else 0)
        with torch.no_grad():
            for p in module.parameters():
                if p.dtype.is_floating_point:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def compile_for_dry_run(spec: str, plan: str):
    """(workload, sources, manifest) of `spec` under `plan`, as a dry run builds them."""
    from threefold.codegen.artifact import build_manifest, build_sources
    from threefold.compiler.api import compile_workload
    from threefold.workload import load_spec
    w = load_spec(spec)
    prog = compile_workload(w, plan)
    sources = build_sources(prog)
    return w, sources, build_manifest(prog, sources, {}, with_weights=False)


def real_rank(spec: str, plan: str, fault: str | None = None, target: int = -1, swap_at: int | None = None,
              steady: bool = False):
    """On a gloo rank: the program's one training step with every collective recorded
    (runtime/comm_log.py), as the dry run records it; (ops, memory by category, loss).
    `steady`: a first step runs before, and the second is measured and its ops returned
    (after the set-up's): the memory of every step but the first, which the dry run's one
    step with the optimizer's state in place must equal."""
    from threefold.runtime.assemble import assemble_rank
    from threefold.runtime.comm_log import record_comm
    from threefold.runtime.dry_run import _step, _step_memory
    from threefold.runtime.optimizers import make_optimizer
    torch.set_num_threads(1)
    w, sources, manifest = compile_for_dry_run(spec, plan)
    source = RandomWeights(sources)
    if fault is not None:
        source = FaultySource(source, sources, target, TRANSFORMS[fault])
    batch = tuple(w.inputs) + (w.target,)
    with record_comm(swap_at=swap_at if dist.get_rank() == target else None) as log:
        engine = assemble_rank(manifest, source, dist.get_rank(), torch.device("cpu"))
        opt = make_optimizer(engine, torch.optim.Adam, None, lr=1e-3, foreach=False)
        if not steady:
            memory = _step_memory(engine, opt, batch)
            return [tuple(op) for op in log.ops], memory, engine.stats.loss
        set_up = len(log.ops)
        _step(engine, opt, batch)     # the first step: the optimizer's state is made at its end
        first = len(log.ops)
        memory = _step_memory(engine, opt, batch)   # the second: what every later step holds
    # the set-up's and the measured step's ops (one step, as the dry run issues)
    return [tuple(op) for op in log.ops[:set_up] + log.ops[first:]], memory, engine.stats.loss


def without_cpu_transport_setup(ops: list[tuple], world: int) -> list[tuple]:
    """`ops` less what only CPU ranks issue: the shared-memory transports' set-up
    (runtime/shm.py: rank 0's token broadcast and the MIN agreements over the job;
    runtime/local_p2p.py: the all-gather of the pipeline's channels), which a
    GPU job, and so the dry run on meta tensors, does not issue."""
    everyone = tuple(range(world))

    def cpu_only(op) -> bool:
        name, group, shape, dtype = op[0], op[1], op[2], op[3]
        return group and group[0] == everyone and (
            name in ("broadcast_object_list", "all_gather_object")
            or (name == "all_reduce" and shape == (1,) and dtype == "int64"))
    return [op for op in ops if not cpu_only(op)]
