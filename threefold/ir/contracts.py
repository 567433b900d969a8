"""What a pass needs and guarantees, in code, and the checks the runner applies.

    @stage_pass(needs=Sharded, gives=Partitioned, requires=("costs",), guarantees=("chunks",))
    def split_pipeline(stage: Sharded) -> Partitioned: ...

`needs`/`gives` are stage types (isinstance); `requires`/`guarantees` name entries of
CHECKS, each a function of the stage that raises ContractError saying what is wrong. The
runner checks `requires` on the input and `guarantees` on the output, and that the input
stage is unchanged (fingerprint), naming the pass on any failure. Calling a pass directly
(tests) checks nothing: the decorator only attaches the declaration.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch.fx as fx

from threefold.ir.program import tf
from threefold.ir.stages import Partitioned, Stage, Traced


class ContractError(AssertionError):
    pass


@dataclass(frozen=True)
class PassSpec:
    needs: type
    gives: type
    requires: tuple[str, ...] = ()
    guarantees: tuple[str, ...] = ()


def stage_pass(needs: type = Stage, gives: type | None = None, requires=(), guarantees=()):
    """Declare a pass: the stage type it reads, the one it returns (default: the same as
    its input), and the named checks that must hold before and after."""
    for name in tuple(requires) + tuple(guarantees):
        if name not in CHECKS:
            raise KeyError(f"unknown contract check {name!r}; known: {sorted(CHECKS)}")

    def deco(fn):
        fn.spec = PassSpec(needs, gives or needs, tuple(requires), tuple(guarantees))
        return fn
    return deco


def spec_of(fn) -> PassSpec:
    return getattr(fn, "spec", None) or PassSpec(Stage, Stage)


# ---- checks --------------------------------------------------------------------------------

def _compute(stage: Stage):
    for where, gm in stage.graph_modules():
        if where == "loss_denominator":
            continue
        for n in gm.graph.nodes:
            if n.op == "call_function":
                yield where, n


def well_formed(stage: Stage) -> None:
    """Every pass leaves this true: graphs lint, every op has a shape, every placeholder a kind."""
    for where, gm in stage.graph_modules():
        gm.graph.lint()
        if where == "loss_denominator":   # a small graph over user inputs, built without shapes
            continue
        for node in gm.graph.nodes:
            if node.op == "call_function" and "val" not in node.meta:
                raise ContractError(f"{where}: node {node.name} has no shape (meta['val'])")
            if node.op == "placeholder" and tf(node).get("kind") not in ("param", "buffer", "input", "boundary"):
                raise ContractError(f"{where}: placeholder {node.name} has no kind")


def _costs(stage: Stage) -> None:
    if isinstance(stage, Traced):
        for where, n in _compute(stage):
            if "cost" not in tf(n) and where == "program":
                raise ContractError(f"node {n.name} has no cost")
    elif isinstance(stage, Partitioned):
        for c in stage.chunks:
            if c.cost is None:
                raise ContractError(f"chunk {c.index} has no cost")


def _placements(stage: Stage) -> None:
    if stage.plan.tp == 1:
        return
    for where, n in _compute(stage):
        if tf(n).get("placement") is None:
            raise ContractError(f"{where}: node {n.name} has no placement under tp={stage.plan.tp}")


def _loss_combined(stage: Stage) -> None:
    if stage.has_loss and stage.loss_form is None:
        raise ContractError("the model has a loss but no loss form (how microbatches combine)")


def _chunks(stage: Stage) -> None:
    if not isinstance(stage, Partitioned):
        raise ContractError(f"a {type(stage).__name__} stage has no chunks")
    if len(stage.chunks) != stage.plan.num_chunks:
        raise ContractError(f"{len(stage.chunks)} chunks for pp*v={stage.plan.num_chunks}")
    covered = [name for c in stage.chunks for name in c.nodes]
    if len(covered) != len(set(covered)):
        raise ContractError("a node belongs to two chunks")
    for c in stage.chunks:
        got = [n for n in c.gm.graph.nodes if n.op == "placeholder" and tf(n).get("kind") == "boundary"]
        if [n.name for n in got] != c.input_names:
            raise ContractError(f"chunk {c.index}: boundary placeholders {[n.name for n in got]} "
                                f"are not its input specs {c.input_names}")
        for n, spec in zip(got, c.inputs):
            val = n.meta.get("val")
            if tuple(val.shape) != spec.shape or val.dtype != spec.dtype:
                raise ContractError(f"chunk {c.index}: input {spec.name} is {tuple(val.shape)}:{val.dtype} "
                                    f"in the graph but {spec.shape}:{spec.dtype} in its spec")
    for a, b in zip(stage.chunks, stage.chunks[1:]):
        if a.outputs != b.inputs:
            raise ContractError(f"chunk {a.index} sends {a.output_names} but chunk {b.index} "
                                f"receives {b.input_names}")


def _kernels(stage: Stage) -> None:
    for _, n in _compute(stage):
        name = getattr(n.target, "kernel_name", None)
        if name is not None and name not in stage.kernels:
            raise ContractError(f"fused node {n.name} uses kernel {name} the stage does not list")


def _recompute(stage: Stage) -> None:
    for c in stage.chunks:
        names = {n.name for n in c.gm.graph.nodes}
        for seg in c.recompute:
            missing = [x for x in seg["nodes"] if x not in names]
            if missing:
                raise ContractError(f"chunk {c.index}: recompute segment {seg['name']} names "
                                    f"{missing[0]}, not in the chunk graph")


CHECKS = {
    "costs": _costs,                 # every compute node (Traced) / chunk (Partitioned) costed
    "placements": _placements,       # tp > 1: every op has a typed placement
    "loss_combined": _loss_combined,  # a loss has its combination over microbatches
    "chunks": _chunks,               # pp*v chunk graphs, disjoint, boundary specs = placeholders
    "kernels": _kernels,             # every fused node's kernel is in stage.kernels
    "recompute": _recompute,         # recompute segments name nodes of their chunk
}


# ---- fingerprint ---------------------------------------------------------------------------

def fingerprint(stage: Stage) -> int:
    """Cheap and sensitive: each graph's nodes (name, target, args/kwargs/val identity, the
    annotation values, which are immutable) and every field's identity/size. A pass that
    changes its input in place changes this."""
    parts = []
    for f in fields(stage):
        v = getattr(stage, f.name)
        if isinstance(v, fx.GraphModule):
            parts.append(_graph_fp(v))
        elif f.name == "chunks":
            parts.extend((tuple(id(getattr(c, k.name)) for k in fields(c)), _graph_fp(c.gm)) for c in v)
        elif isinstance(v, (dict, list)):
            parts.append((id(v), len(v)))
        else:
            parts.append(id(v))
    return hash(tuple(parts))


def _graph_fp(gm: fx.GraphModule) -> int:
    return hash(tuple((n.name, id(n.target), id(n._args), id(n._kwargs), id(n.meta.get("val")),
                       tuple(n.meta["tf"].items()) if n.meta.get("tf") else None)
                      for n in gm.graph.nodes))
