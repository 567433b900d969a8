"""The compiler's stages: immutable values, each pass maps one to the next.

    Traced       one fx graph of the model + loss (compiler/trace.py), shapes on every node
      |  check_batch_coupling, loss_form                         Traced -> Traced
    Sharded      the same graph in local (per tp rank) shapes, placements, collectives,
      |          shard specs for the sharded weights              (tensor_parallel)
      |  annotate_costs                                           Sharded -> Sharded
    Partitioned  one graph per chunk, NO whole-program graph; boundaries are BoundarySpecs
      |                                                           (split_pipeline)
    Fused        chunk graphs with fused-kernel regions, `kernels` (fuse)
         seed_random_ops, plan_recompute                          Fused -> Fused

A pass never changes its input: it reads it, builds a new graph where it rewrites one
(`copy_graph_module`), and returns a new stage (`stage.evolve(...)`, `stage.advance(Cls,
...)`, or `stage.draft()` ... `draft.freeze(Cls)` for passes written against a mutable
Program). The runner (compiler/pipeline.py) fingerprints every input and fails a pass that
touched it. Stages save to and load from directories (ir/stage_io.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from threefold.ir.program import Sized, TensorMeta, format_stage, tf
from threefold.placement import OnMesh, R, Placement, on_mesh_of
from threefold.plan import Plan


@dataclass(frozen=True)
class BoundarySpec(Sized):
    """A value crossing a chunk boundary: its name (the same in the sender's and the
    receiver's graph), local (per tp rank) shape, dtype, tensor-parallel placement and the
    placements on the other mesh axes that split it (read from the node's OnMesh)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement = R
    axes: tuple[tuple[str, Placement], ...] = ()    # other mesh axes than tp that split it

    @classmethod
    def of(cls, node: fx.Node) -> "BoundarySpec":
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise AssertionError(f"boundary value {node.name} is not a tensor")
        on = on_mesh_of(node)
        return cls(node.name, tuple(int(s) for s in val.shape), val.dtype, on["tp"],
                   tuple((a, p) for a, p in on.items if a != "tp"))

    @property
    def on_mesh(self) -> OnMesh:
        """The placement on every mesh axis (tp included)."""
        return OnMesh(self.axes).with_axis("tp", self.placement)


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk: its own graph and what crosses its edges.

    The graph's placeholders come in a fixed order that codegen and the runtime share:
    boundary values received (kind 'boundary', = `inputs`), user inputs read from the batch
    (kind 'input'), then parameters and buffers; its output is the tuple `outputs` (for the
    last chunk the model's outputs, the loss)."""
    index: int
    gm: fx.GraphModule
    nodes: tuple[str, ...]                  # compute node names, in graph order
    inputs: tuple[BoundarySpec, ...]        # received from the previous chunk
    outputs: tuple[BoundarySpec, ...]       # sent to the next chunk (last: the loss)
    user_inputs: tuple[int, ...]            # indices of user inputs read directly from the batch
    params: tuple[str, ...]                 # canonical FQNs used
    buffers: tuple[str, ...]                # buffer / constant names used
    recomputed: tuple[str, ...] = ()        # cheap shared (free) nodes copied in
    cost: Any = None                        # passes.cost.ChunkCost, per tp rank, at partition time
    recompute: tuple = ()                   # segments rerun in backward (passes/recompute.py)
    units: tuple = ()                       # zero>=2: parameter units (passes/shard_units.py)
    experts: tuple = ()                     # expert regions (passes/experts.py)
    module_experts: tuple = ()              # experts held as separate modules (passes/module_experts.py)

    @property
    def input_names(self) -> list[str]:
        return [b.name for b in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [b.name for b in self.outputs]

    def node(self, name: str) -> fx.Node:
        """The node called `name` in this chunk's graph."""
        for n in self.gm.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(f"chunk {self.index} has no node {name}")

    def evolve(self, **changes) -> "Chunk":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Stage:
    """What every stage knows: the model, the plan, the weights, the loss's combination."""
    name: str                        # model class name, for messages and headers
    plan: Plan
    state: dict                      # canonical FQN / buffer name -> tensor (real or meta); never mutated
    ties: dict                       # canonical FQN -> every FQN of that tied parameter
    input_names: tuple[str, ...]     # user inputs in call order (model inputs, then target)
    num_model_inputs: int
    has_loss: bool                   # the graph's single output is the loss
    output_meta: tuple[TensorMeta, ...] = ()
    notes: tuple[str, ...] = ()      # shown by inspect
    pass_log: tuple[tuple[str, float], ...] = ()
    # how the loss combines microbatches and dp ranks (passes/loss_form.py; manifest "loss")
    loss_form: dict | None = None
    # graph of the loss denominator over user inputs (and buffers), or None
    loss_denominator: fx.GraphModule | None = None
    batch_dims: list | None = None   # per user input: its batch dim, None = not split
    micro_rows: int | None = None    # rows (batch-dim length) of the traced microbatch
    # cp > 1: the sequence length traced, this cp rank's share S / cp (each user input's
    # sequence dim is its placeholder's cp entry, threefold/placement.OnMesh)
    seq_len: int | None = None
    # cp > 1: positions the sequence was padded by at the end so 2cp blocks cut it
    # (runtime/cp_ops.seq_tail): the whole traced sequence is seq_len * cp, the real one that
    # minus seq_tail; what the padded positions hold stands for nothing (passes/cp_tails.py)
    seq_tail: int = 0
    # cp > 1: n -> the same model traced at a local length of n (compiler/api.py), which tells
    # a size that is the sequence length from one equal to it by coincidence (passes/cp_masks.py)
    retrace: Callable | None = field(default=None, compare=False, repr=False)
    output_batch_dims: list | None = None  # per model output: its batch dim (forward-only)
    # With a loss: the model's own outputs (the loss_fn's input) by value name, None where
    # the loss does not read one, and their full shapes; pm(x) returns them (codegen writes
    # the last chunk's `model_outputs` method, codegen/model_outputs.py)
    model_outputs: tuple = ()
    model_output_meta: tuple = ()
    # the structure of the model's return value, as JSON (runtime/output_tree.py): pm(x)
    # puts the output tensors back into it (a tensor for a tensor, a dict for a dict ...)
    output_tree: dict | None = None

    @property
    def is_meta(self) -> bool:
        return any(t.is_meta for t in self.state.values())

    def evolve(self, **changes) -> "Stage":
        """A new stage of the same type with `changes`."""
        return dataclasses.replace(self, **changes)

    def advance(self, cls: type, **extra) -> "Stage":
        """The next stage type, carrying every field both types have."""
        names = {f.name for f in fields(cls)}
        carried = {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}
        carried.update(extra)
        return cls(**carried)

    def noted(self, *notes: str) -> "Stage":
        return self.evolve(notes=self.notes + tuple(notes))

    def draft(self, copy_graphs: bool = True) -> "Draft":
        """A private mutable copy (graphs copied unless told not to), for passes written
        as in-place rewrites; `draft.freeze()` makes it a stage again."""
        return Draft(self, copy_graphs)

    def graph_modules(self) -> list[tuple[str, fx.GraphModule]]:
        """Every graph this stage holds, named (the runner fingerprints and lints them)."""
        out = []
        if self.loss_denominator is not None:
            out.append(("loss_denominator", self.loss_denominator))
        return out

    def __str__(self) -> str:
        return format_stage(self)


@dataclass(frozen=True)
class Traced(Stage):
    gm: fx.GraphModule | None = None

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def node(self, name: str) -> fx.Node:
        for n in self.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def param_names(self) -> list[str]:
        return [tf(n)["fqn"] for n in self.graph.nodes if n.op == "placeholder" and tf(n)["kind"] == "param"]

    def graph_modules(self):
        return [("program", self.gm)] + super().graph_modules()


@dataclass(frozen=True)
class Sharded(Traced):
    """Local shapes; placements and collectives on nodes (tp > 1)."""
    # FQN -> ShardSpec: fn(full tensor, tp_rank) -> this rank's shard; absent = whole
    shard_fns: dict = field(default_factory=dict)
    # parameters applied to sharded activations (sequence-parallel norms): grads summed over tp
    tp_grad_sync: tuple[str, ...] = ()
    tp_report: dict | None = None    # sharded share, fallbacks, kept-whole weights


@dataclass(frozen=True)
class Partitioned(Stage):
    """One graph per chunk and no whole-program graph."""
    shard_fns: dict = field(default_factory=dict)
    tp_grad_sync: tuple[str, ...] = ()
    tp_report: dict | None = None
    chunks: tuple[Chunk, ...] = ()
    source_order: tuple[str, ...] = ()   # compute node names in the traced graph's order
    user_inputs: tuple[BoundarySpec, ...] = ()   # the batch's tensors, by position (manifest "inputs")
    kernels: dict = field(default_factory=dict)   # fused-kernel name -> region (Fused)

    def graph_modules(self):
        return [(f"chunk{c.index:02d}", c.gm) for c in self.chunks] + super().graph_modules()

    def chunk_nodes(self):
        """(chunk, node) for every node of every chunk graph, in order."""
        for c in self.chunks:
            for n in c.gm.graph.nodes:
                yield c, n


@dataclass(frozen=True)
class Fused(Partitioned):
    """Fusion decided (kernels empty when the plan does not fuse)."""


Program = Stage     # the stage every pass reads and returns, under its older name

STAGE_TYPES = {cls.__name__: cls for cls in (Traced, Sharded, Partitioned, Fused)}


class Draft:
    """A mutable working copy of a stage, private to one pass (see Stage.draft)."""

    def __init__(self, stage: Stage, copy_graphs: bool):
        self._cls = type(stage)
        for f in fields(stage):
            v = getattr(stage, f.name)
            if isinstance(v, (list, tuple)) and f.name in ("notes", "pass_log", "chunks", "tp_grad_sync"):
                v = list(v)
            elif isinstance(v, dict) and f.name in ("shard_fns", "kernels", "loss_form"):
                v = dict(v)
            setattr(self, f.name, v)
        if copy_graphs:
            if getattr(self, "gm", None) is not None:
                self.gm = copy_graph_module(self.gm)
            if getattr(self, "chunks", None):
                self.chunks = [c.evolve(gm=copy_graph_module(c.gm)) for c in self.chunks]

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def node(self, name: str) -> fx.Node:
        return next(n for n in self.graph.nodes if n.name == name)

    @property
    def is_meta(self) -> bool:
        return any(t.is_meta for t in self.state.values())

    def freeze(self, cls: type | None = None, **extra) -> Stage:
        cls = cls or self._cls
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(self).items() if k in names}
        values.update(extra)
        for k in ("notes", "pass_log", "chunks", "tp_grad_sync"):
            if k in values and isinstance(values[k], list):
                values[k] = tuple(values[k])
        return cls(**values)


def copy_graph_module(gm: fx.GraphModule, class_name: str | None = None) -> fx.GraphModule:
    """A copy of `gm` with the same node names and copied meta/annotation dicts (the
    values in them are immutable or shared read-only), ready for in-place rewriting."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        new = g.node_copy(n, env.__getitem__)
        new.meta = dict(n.meta)
        if "tf" in n.meta:
            new.meta["tf"] = dict(n.meta["tf"])
        env[n] = new
    g._codegen = gm.graph._codegen
    out = _LazyGraphModule(gm, g, class_name=class_name or type(gm).__name__)
    out.meta = dict(getattr(gm, "meta", {}))
    return out
