"""Stages as directories (save_stage / load_stage); a stage as text is ir/program.format_stage."""
from __future__ import annotations

# ---- save / load ---------------------------------------------------------------------------
#
# A stage directory holds stage.pkl (the stage value), stage.txt (format_stage) and
# stage.json (its kind, plan, versions). fx GraphModules do not pickle with their node meta
# (GraphModule.__reduce__ regenerates the graph from code), and ATen ops and fake tensors do
# not pickle at all, so a custom pickler writes each graph as a list of node records (op,
# name, target, args with nodes as names, and the meta keys the compiler reads: 'val' as a
# meta tensor of the same shape/stride/dtype, 'tf' with its typed annotations,
# 'nn_module_stack', 'stack_trace'), ATen ops by qualified name, fake tensors as meta
# tensors. Loading runs pickle: a stage directory is code, like an artifact; load only your own.

import io
import json
import os
import pickle

import torch
from torch._subclasses.fake_tensor import FakeTensor
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

import threefold
from threefold.errors import PlanError
from threefold.ir.program import format_stage
from threefold.ir.stages import Stage

STAGE_FILE = "stage.pkl"
_META_KEYS = ("val", "tf", "on_mesh", "nn_module_stack", "stack_trace")


class _Ref:
    """A node argument, by the name of the node it refers to (inside one graph record)."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_Ref, (self.name,))


def _op(qualified: str, overload: str):
    ns, name = qualified.split("::")
    packet = getattr(getattr(torch.ops, ns), name)
    return packet if overload is None else getattr(packet, overload)


def _meta_tensor(shape, stride, dtype, requires_grad=False):
    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return t.requires_grad_(requires_grad) if requires_grad and dtype.is_floating_point else t


def _graph_module(records, attrs, class_name, gm_meta):
    g = fx.Graph()
    env: dict[str, fx.Node] = {}

    def back(a):
        return env[a.name] if isinstance(a, _Ref) else a
    for op, name, target, args, kwargs, meta in records:
        node = g.create_node(op, target, fx.node.map_aggregate(args, back),
                             fx.node.map_aggregate(kwargs, back), name=name)
        if node.name != name:
            raise ValueError(f"saved graph: node {name} came back as {node.name}")
        node.meta = meta
        env[name] = node
    root = torch.nn.Module()
    for k, v in attrs.items():
        setattr(root, k, v)
    gm = _LazyGraphModule(root, g, class_name=class_name)
    gm.meta = gm_meta
    return gm


# Modules a saved stage may name from before they moved (compiler/ -> ir/, cost -> passes/).
_MOVED = {f"threefold.compiler.{m}": f"threefold.ir.{m}"
          for m in ("program", "stages", "stage_io", "contracts", "annotations")}
_MOVED["threefold.compiler.cost"] = "threefold.passes.cost"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return super().find_class(_MOVED.get(module, module), name)


class _StagePickler(pickle.Pickler):
    def __init__(self, f, weights: bool):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.weights = weights

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op, (obj._qualified_op_name, None)
        if isinstance(obj, torch.Tensor) and (obj.is_meta or not self.weights or _is_fake(obj)):
            return _meta_tensor, (tuple(int(s) for s in obj.shape), tuple(int(s) for s in obj.stride()),
                                  obj.dtype, bool(obj.requires_grad))
        if isinstance(obj, fx.GraphModule):
            records, attrs = [], {}
            for n in obj.graph.nodes:
                args = fx.node.map_arg(n.args, lambda x: _Ref(x.name))
                kwargs = fx.node.map_arg(n.kwargs, lambda x: _Ref(x.name))
                meta = {k: n.meta[k] for k in _META_KEYS if k in n.meta}
                records.append((n.op, n.name, n.target, args, kwargs, meta))
                if n.op == "get_attr":
                    attrs[n.target] = getattr(obj, n.target)
            return _graph_module, (records, attrs, type(obj).__name__, dict(getattr(obj, "meta", {})))
        return NotImplemented


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def save_stage(stage, directory: str, weights: bool = True) -> str:
    """Write `stage` to `directory` (created). weights=False keeps only the shapes of the
    state tensors (enough for codegen and its golden tests)."""
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    if getattr(stage, "retrace", None) is not None:   # a closure over the user's model: not data, not saved
        stage = stage.evolve(retrace=None)
    _StagePickler(buf, weights).dump(stage)
    with open(os.path.join(directory, STAGE_FILE), "wb") as f:
        f.write(buf.getvalue())
    with open(os.path.join(directory, "stage.txt"), "w") as f:
        f.write(format_stage(stage) + "\n")
    with open(os.path.join(directory, "stage.json"), "w") as f:
        json.dump({"stage": type(stage).__name__, "model": stage.name, "plan": str(stage.plan),
                   "passes": [name for name, _ in stage.pass_log], "weights": weights,
                   "threefold_version": threefold.__version__, "torch_version": torch.__version__},
                  f, indent=2)
    return directory


def load_stage(directory: str):
    """The stage `save_stage` wrote into `directory` (a stage type from ir/stages.py).
    A saved stage is code, like an artifact (a pickle of fx graphs): load only your own."""
    path = os.path.join(directory, STAGE_FILE)
    if not os.path.isfile(path):
        raise PlanError(f"{directory} is not a saved stage (no {STAGE_FILE}); save one with "
                        "threefold.ir.stage_io.save_stage or THREEFOLD_DEBUG_DIR")
    with open(path, "rb") as f:
        stage = _Unpickler(f).load()
    if not isinstance(stage, Stage):
        raise PlanError(f"{path} holds a {type(stage).__name__}, not a compiler stage")
    return stage


def stage_to_bytes(stage, weights: bool = False) -> bytes:
    """`stage` pickled as save_stage writes it (for a compile done in a child process)."""
    buf = io.BytesIO()
    _StagePickler(buf, weights).dump(stage)
    return buf.getvalue()


def stage_from_bytes(data: bytes):
    """The stage `stage_to_bytes` wrote (trusted bytes only: this runs pickle)."""
    return _Unpickler(io.BytesIO(data)).load()
