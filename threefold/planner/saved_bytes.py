"""Bytes autograd keeps for backward, derived from a compiled graph by running its ops on fakes.

No per-op table and no transformer formula: every op of the graph is run once, alone, on
fake tensors (torch's FakeTensorMode: shapes, strides and dtypes, no data, no memory) of
its inputs' recorded shapes, with requires_grad as autograd would see it, under
saved-tensor hooks. What the hooks see is what the op's autograd formula saves:

  * one of its inputs (or a view of one): that value is kept, once however many ops keep it;
  * its output (or a view of it): the output is kept;
  * a tensor of its own (layer norm's mean and rstd, a dropout mask): kept under the op's name.

Values are followed to their storage: a view op's output shares its input's storage (the
fake run says so), so q, k and v split from one QKV projection are one value, as they are
to `runtime/memory.SavedTensorCounter`, which measures the real thing. Parameters and
buffers are state, not activations, and never count.

Recomputed segments (passes/recompute.py, `Chunk.recompute`) run under
torch.utils.checkpoint: their ops keep nothing, and the segment's inputs are kept instead.
While backward reruns a segment, its own saved values exist again for a moment: the
largest segment's are `recompute_peak_bytes`.

An op that cannot run on fakes (a fused Triton kernel) falls back to passes/cost.py's
SAVE_RULES for that op, and is listed in `fallbacks`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import weakref

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch._subclasses.fake_tensor import FakeTensorMode
from threefold.runtime import random_ops, tp_ops
from threefold.runtime import tp_ops
from threefold.ir.program import tf

_NO_GRAD_KINDS = ("input", "buffer")


@dataclass
class ChunkSaved:
    """What one microbatch's forward of one chunk keeps for backward (bytes, per tp rank)."""
    saved_bytes: int = 0                 # values autograd keeps (incl. recomputed segments' inputs)
    recompute_peak_bytes: int = 0        # the largest segment's saved values, alive while it reruns
    boundary_bytes: int = 0              # received inputs (held by the engine until backward)
    boundary_unsaved_bytes: int = 0      # ... of which no op keeps (so not in saved_bytes)
    unsaved_bytes: int = 0               # values the forward makes that no op keeps: alive until
                                         # the generated forward returns (its locals hold them),
                                         # and the largest temporaries inside one op
    values: dict = field(default_factory=dict)   # value -> bytes behind saved_bytes
    fallbacks: list = field(default_factory=list)


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


class _Runner:
    """Runs single nodes on fake tensors; remembers each node's storage roots."""

    def __init__(self, gm: fx.GraphModule, autocast: torch.dtype | None = None):
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.gm = gm
        self.root: dict[str, object] = {}       # node -> root value name (or tuple of them)
        self.nbytes: dict[str, int] = {}        # root value name -> storage bytes
        self.grad: dict[str, object] = {}       # node -> requires_grad (or tuple)
        self.dtype: dict[str, object] = {}      # node -> dtype its fake run produced (or tuple)
        self.autocast = autocast                # e.g. torch.bfloat16: run ops as autocast would
        self.saved: dict[str, list[tuple[str, int]]] = {}   # node -> [(value, bytes)] it keeps
        self.state: set[str] = set()            # roots that are parameters/buffers
        self.transient: dict[str, int] = {}     # node -> bytes of its own temporaries at their peak
        self.fallbacks: list[str] = []

    # -- building fake inputs -------------------------------------------------------
    def _fake(self, val, requires_grad: bool, dtype=None):
        dtype = dtype or val.dtype   # the dtype the producer really made (autocast changes it)
        t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=dtype, device="cpu")
        if requires_grad and val.dtype.is_floating_point:
            t.requires_grad_(True)
        return t

    def _arg(self, a, tensors: list):
        if isinstance(a, fx.Node):
            val = _val(a)
            if isinstance(val, torch.Tensor):
                g = self.grad.get(a.name, False)
                d = self.dtype.get(a.name)
                t = self._fake(val, bool(g) if not isinstance(g, tuple) else False,
                               d if isinstance(d, torch.dtype) else None)
                tensors.append((t, a.name))
                return t
            if isinstance(val, (tuple, list)):
                roots = self.root.get(a.name) or ()
                grads = self.grad.get(a.name) or ()
                dtypes = self.dtype.get(a.name) or ()
                out = []
                for i, v in enumerate(val):
                    if isinstance(v, torch.Tensor):
                        t = self._fake(v, bool(grads[i]) if i < len(grads) else False,
                                       dtypes[i] if isinstance(dtypes, tuple) and i < len(dtypes) else None)
                        tensors.append((t, (a.name, i, roots[i] if i < len(roots) else None)))
                        out.append(t)
                    else:
                        out.append(v)
                return type(val)(out)
            return val
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x, tensors) for x in a)
        if isinstance(a, dict):
            return {k: self._arg(v, tensors) for k, v in a.items()}
        if isinstance(a, random_ops.RngRef):
            return 0
        if isinstance(a, random_ops.TrainFlag):
            return True          # training: the masks and statistics backward needs
        if isinstance(a, random_ops.TrainValue):
            return a.value
        if isinstance(a, tp_ops.GroupRef):
            return None          # one rank's view: collectives are identities, shapes are local
        return a

    def _root_of(self, ref) -> str | None:
        if isinstance(ref, tuple):               # (tuple node, index, root)
            return ref[2]
        r = self.root.get(ref)
        return r if isinstance(r, str) else None

    # -- one node -------------------------------------------------------------------
    def placeholder(self, node: fx.Node, kind: str | None, trainable: bool) -> None:
        val = _val(node)
        self.root[node.name] = node.name
        if isinstance(val, torch.Tensor):
            self.nbytes[node.name] = _storage_bytes(val)
        if kind in ("param", "buffer"):
            self.state.add(node.name)
        self.grad[node.name] = (kind == "param" and trainable) or (kind == "boundary")

    def call(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            parent, i = node.args[0], node.args[1]
            roots, grads = self.root.get(parent.name), self.grad.get(parent.name)
            dtypes = self.dtype.get(parent.name)
            self.root[node.name] = roots[i] if isinstance(roots, tuple) and i < len(roots) else node.name
            self.grad[node.name] = grads[i] if isinstance(grads, tuple) and i < len(grads) else False
            if isinstance(dtypes, tuple) and i < len(dtypes):
                self.dtype[node.name] = dtypes[i]
            self.saved[node.name] = []
            return
        if node.target is tp_ops.all_gather_seq:
            # what autograd keeps of a sequence all-gather is its shard (runtime/saved_shards.py)
            shard = node.args[0]
            self.root[node.name] = self.root.get(shard.name, shard.name)
            self.grad[node.name] = self.grad.get(shard.name, False)
            if shard.name in self.dtype:
                self.dtype[node.name] = self.dtype[shard.name]
            self.saved[node.name] = []
            return
        try:
            self._run(node)
        except Exception:   # noqa: BLE001  an op fakes cannot run: the cost table's rule
            self._fallback(node)

    def _run(self, node: fx.Node) -> None:
        packed: list[torch.Tensor] = []

        def pack(t):
            packed.append(t)
            return t

        with self.mode:
            tensors: list = []
            args = self._arg(node.args, tensors)
            kwargs = self._arg(node.kwargs, tensors)
            temps = _Temporaries()
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None), \
                    temps:
                out = node.target(*args, **kwargs)
        self.transient[node.name] = temps.peak_beyond(out, packed)
        by_storage = {}
        for t, ref in tensors:
            by_storage.setdefault(_key(t), ref)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # A collective's output is a new buffer on a real rank (all-gather, all-reduce),
        # though with no group it returns its input: only f (identity forward) aliases.
        fresh = getattr(node.target, "__module__", "") == tp_ops.__name__ and node.target is not tp_ops.f
        roots, grads, dtypes = [], [], []
        for i, o in enumerate(outs):
            dtypes.append(o.dtype if isinstance(o, torch.Tensor) else None)
            if not isinstance(o, torch.Tensor):
                roots.append(None)
                grads.append(False)
                continue
            ref = None if fresh else by_storage.get(_key(o))
            name = self._root_of(ref) if ref is not None else None
            if name is None:
                name = node.name if len(outs) == 1 else f"{node.name}.{i}"
                # a collective run without a group returns its input's shape: the recorded
                # (gathered) shape is what a real rank allocates
                val = _val(node)
                val = val[i] if isinstance(val, (tuple, list)) and i < len(val) else val
                self.nbytes[name] = _storage_bytes(val) if fresh and isinstance(val, torch.Tensor) \
                    else o.untyped_storage().nbytes()
            roots.append(name)
            grads.append(bool(o.requires_grad))
            by_storage.setdefault(_key(o), ("out", i, name))
        single = not isinstance(out, (tuple, list))
        self.root[node.name] = roots[0] if single else tuple(roots)
        self.grad[node.name] = grads[0] if single else tuple(grads)
        self.dtype[node.name] = dtypes[0] if single else tuple(dtypes)
        kept: dict[str, int] = {}
        own: dict[int, str] = {}   # storage -> name of a tensor of the op's own (saved twice: once)
        for t in packed:
            ref = by_storage.get(_key(t))
            if ref is not None:
                name = ref[2] if isinstance(ref, tuple) else self._root_of(ref)
                if name is None or name in self.state:
                    continue
                kept[name] = self.nbytes.get(name, t.untyped_storage().nbytes())
            else:
                name = own.setdefault(_key(t), f"{node.name}#{len(own)}")
                kept[name] = t.untyped_storage().nbytes()
        self.saved[node.name] = list(kept.items())

    def _fallback(self, node: fx.Node) -> None:
        # lazy: start-up: threefold.passes.cost loads 9 more modules only when this runs
        from threefold.passes.cost import node_cost
        self.fallbacks.append(node.name)
        self.root[node.name] = node.name
        val = _val(node)
        if isinstance(val, torch.Tensor):
            self.nbytes[node.name] = _storage_bytes(val)
        self.grad[node.name] = any(bool(self.grad.get(a.name)) for a in node.all_input_nodes
                                   if not isinstance(self.grad.get(a.name), tuple))
        kept = []
        for value, nbytes in node_cost(node).saved:
            base = value.split(".mask")[0]
            root = self.root.get(base)
            if isinstance(root, str) and root in self.state:
                continue
            kept.append((root if isinstance(root, str) and base == value else value, nbytes))
        self.saved[node.name] = kept


class _Temporaries(TorchDispatchMode):
    """The bytes an op allocates inside itself (a runtime op made of several aten ops: a
    vocabulary-parallel cross entropy's exp and masks): the peak of its new storages alive,
    less what it returns and keeps (those are counted as values)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.sizes = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                key = _key(t)
                if key not in self.sizes:
                    n = t.untyped_storage().nbytes()
                    self.sizes[key] = n
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key)
        return out

    def _free(self, key) -> None:
        self.live -= self.sizes.get(key, 0)
        self.sizes[key] = 0

    def peak_beyond(self, out, packed) -> int:
        mine = {_key(t) for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)}
        mine |= {_key(t) for t in packed}
        return max(0, self.peak - sum(n for k, n in self.sizes.items() if k in mine))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _storage_bytes(val) -> int:
    if not isinstance(val, torch.Tensor) or val.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(val.shape, val.stride()))
    return span * val.element_size()


def chunk_saved(gm: fx.GraphModule, autocast: torch.dtype | None = None, segments=None) -> ChunkSaved:
    """Bytes one microbatch's forward through this chunk graph keeps for backward
    (`autocast`: the 16-bit dtype generated code computes in under dtype=bf16|fp16;
    `segments`: the chunk's recomputed segments, passes/recompute.py)."""
    runner = _Runner(gm, autocast)
    segments = list(segments if segments is not None else gm.meta.get("recompute") or [])
    segment_of = {name: i for i, seg in enumerate(segments) for name in seg["nodes"]}
    boundary = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind = tf(node).get("kind")
            runner.placeholder(node, kind, not tf(node).get("frozen"))
            if kind == "boundary":
                boundary.append(node.name)
        elif node.op == "call_function":
            runner.call(node)
    kept: dict[str, int] = {}
    per_segment: list[dict[str, int]] = [{} for _ in segments]
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        seg = segment_of.get(node.name)
        if seg is None:
            kept.update(runner.saved.get(node.name, []))
            continue
        per_segment[seg].update(runner.saved.get(node.name, []))
        for a in node.all_input_nodes:   # a segment keeps its inputs (checkpoint holds them)
            if segment_of.get(a.name) == seg:
                continue
            roots = runner.root.get(a.name)
            for r in (roots if isinstance(roots, tuple) else (roots,)):
                if isinstance(r, str) and r not in runner.state and r in runner.nbytes:
                    kept[r] = runner.nbytes[r]
    out = ChunkSaved(values=kept, fallbacks=runner.fallbacks)
    out.saved_bytes = sum(kept.values())
    out.recompute_peak_bytes = max((sum(b for v, b in s.items() if v not in kept) for s in per_segment),
                                   default=0)
    out.boundary_bytes = sum(runner.nbytes.get(b, 0) for b in boundary)
    out.boundary_unsaved_bytes = sum(runner.nbytes.get(b, 0) for b in boundary if b not in kept)
    inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    out.unsaved_bytes = sum(b for v, b in runner.nbytes.items()
                            if v not in inputs and v not in runner.state and v not in kept) + max(
        runner.transient.values(), default=0)
    return out


def nodes_saved(gm: fx.GraphModule, names, segments=(), autocast: torch.dtype | None = None) -> dict[str, tuple[int, str]]:
    """What the ops called `names` (a part of the graph: one layer) keep for backward, as
    {value: (bytes, producing node)}, with `segments` (lists of node names) recomputed: their
    ops keep nothing, their inputs are kept. The whole graph is run so values keep their roots."""
    runner = _Runner(gm, autocast)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            runner.placeholder(node, tf(node).get("kind"), not tf(node).get("frozen"))
        elif node.op == "call_function":
            runner.call(node)
    wanted = set(names)
    segment_of = {n: i for i, seg in enumerate(segments) for n in seg}
    by_name = {n.name: n for n in gm.graph.nodes}
    kept: dict[str, tuple[int, str]] = {}
    for name in names:
        node = by_name[name]
        seg = segment_of.get(name)
        if seg is None:
            for value, nbytes in runner.saved.get(name, []):
                kept[value] = (nbytes, value.split("#")[0] if "#" in value else value)
            continue
        for a in node.all_input_nodes:
            if segment_of.get(a.name) == seg:
                continue
            roots = runner.root.get(a.name)
            for r in (roots if isinstance(roots, tuple) else (roots,)):
                if isinstance(r, str) and r not in runner.state and r in runner.nbytes:
                    kept[r] = (runner.nbytes[r], r)
    del wanted
    return kept
