"""Front end: an unmodified nn.Module (plus its loss) -> a `Program` over ATen ops.

We use torch.export in non-strict mode, which gives the training IR: ATen ops that autograd
can differentiate (aten.linear, aten.layer_norm, ...), every node with a fake tensor in
meta["val"], parameters and buffers lifted to placeholders. Models on the meta device trace
without allocating memory. After export we
  * wrap the loss into the graph (when loss_fn is given), so its output is a scalar loss;
  * map placeholders to canonical FQNs and merge tied parameters into one placeholder;
  * inline grad-mode / autocast higher-order ops (their no_grad outputs get a detach).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind

from threefold.compiler.program import Program, TensorMeta, tf
from threefold.errors import PlanError
from threefold.plan import Plan


class _ModelWithLoss(torch.nn.Module):
    """Puts the loss in the graph: forward(*inputs, target) -> loss_fn(model(*inputs), target)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args):
        if self.loss_fn is None:
            return self.model(*args)
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


def trace(model: torch.nn.Module, inputs: tuple, target=None, loss_fn: Callable | None = None,
          plan: Plan | None = None) -> Program:
    """Export `model` (with `loss_fn` when given) on example `inputs` to a Program."""
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"cannot trace a {type(model).__name__}: pass a torch.nn.Module")
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    has_loss = loss_fn is not None
    if has_loss and target is None:
        raise PlanError(f"{type(model).__name__}: loss_fn was given but no target: pass the example target too")
    args = inputs + ((target,) if has_loss else ())
    wrapper = _ModelWithLoss(model, loss_fn)
    ep = _export(wrapper, args, type(model).__name__)
    prog = _to_program(ep, model, wrapper, len(inputs), has_loss, plan or Plan())
    return prog


def _export(wrapper: torch.nn.Module, args: tuple, name: str):
    start = time.perf_counter()
    try:
        with torch.no_grad() if False else _nullcontext():
            ep = torch.export.export(wrapper, args, strict=False)
    except Exception as exc:  # export raises many types; all mean "cannot trace"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlanError(
            f"cannot trace {name}: torch.export rejected it ({type(exc).__name__}: {first[:300]}); "
            "make forward free of data-dependent Python control flow and .item()/.tolist() calls, "
            "pass plain tensors as inputs, and for Hugging Face models set use_cache=False"
        ) from None
    ep._threefold_export_seconds = time.perf_counter() - start
    return ep


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _to_program(ep, model, wrapper, num_model_inputs: int, has_loss: bool, plan: Plan) -> Program:
    gm: fx.GraphModule = ep.graph_module
    graph = gm.graph
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}

    # Tied parameters: same tensor object under several names. Canonical = first name.
    canonical: dict[str, str] = {}
    ties: dict[str, list[str]] = {}
    first_by_id: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in first_by_id:
            canonical[fqn] = first_by_id[key]
            ties.setdefault(first_by_id[key], [first_by_id[key]]).append(fqn)
        else:
            first_by_id[key] = fqn
            canonical[fqn] = fqn

    state: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    placeholder_by_fqn: dict[str, fx.Node] = {}
    input_names: list[str] = []
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        spec = specs[node.name]
        ann = tf(node)
        if spec.kind == InputKind.PARAMETER:
            fqn = canonical[_strip(spec.target)]
            if fqn in placeholder_by_fqn:  # an alias of a tied parameter: reuse the first
                node.replace_all_uses_with(placeholder_by_fqn[fqn])
                graph.erase_node(node)
                continue
            placeholder_by_fqn[fqn] = node
            ann.update(kind="param", fqn=fqn)
            state[fqn] = params[fqn].detach()
        elif spec.kind == InputKind.BUFFER:
            fqn = _strip(spec.target)
            ann.update(kind="buffer", fqn=fqn)
            state[fqn] = buffers[fqn].detach()
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            if spec.kind == InputKind.CUSTOM_OBJ:
                raise PlanError(f"cannot compile {type(model).__name__}: it holds a script object "
                                f"({spec.target}); use plain tensors")
            fqn = f"_const.{spec.target}"
            ann.update(kind="buffer", fqn=fqn)
            state[fqn] = ep.constants[spec.target].detach()
        elif spec.kind == InputKind.USER_INPUT:
            ann.update(kind="input", input_index=len(input_names))
            input_names.append(node.name)
        else:
            raise PlanError(f"cannot compile {type(model).__name__}: unsupported input kind {spec.kind}")

    _inline_higher_order_ops(gm)
    _record_module_paths(graph)
    graph.eliminate_dead_code()
    gm.recompile()

    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = out_node.args[0]
    output_meta = [TensorMeta.of(o.meta["val"]) for o in outs if isinstance(o, fx.Node)
                   and isinstance(o.meta.get("val"), torch.Tensor)]
    if has_loss and (len(outs) != 1 or output_meta[0].numel != 1):
        raise PlanError(f"{type(model).__name__}: loss_fn must return one scalar tensor, "
                        f"got {len(outs)} outputs")
    prog = Program(name=type(model).__name__, gm=gm, plan=plan, state=state, ties=ties,
                   input_names=input_names, num_model_inputs=num_model_inputs,
                   has_loss=has_loss, output_meta=output_meta)
    prog.pass_log.append(("export", getattr(ep, "_threefold_export_seconds", 0.0)))
    return prog


def _strip(target: str) -> str:
    return target[len("model."):] if target.startswith("model.") else target


_GRAD_HOP = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
_AUTOCAST_HOP = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def _inline_higher_order_ops(gm: fx.GraphModule) -> None:
    """Replace set_grad_enabled / autocast wrappers by their body's nodes.

    A no_grad region's outputs get an aten.detach so gradients stop there, as they did in
    the model. An enabled autocast region would change dtypes, which we do not model yet.
    """
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (_GRAD_HOP, _AUTOCAST_HOP):
                continue
            if node.target is _GRAD_HOP:
                grad_enabled, sub_node, *operands = node.args
            else:
                enabled, sub_node = node.args[0], node.args[4]
                operands = list(node.args[5:])
                if enabled:
                    raise PlanError("the model runs a region under torch.autocast(enabled=True); "
                                    "threefold compiles fp32/bf16 models as they are: cast the model instead")
                grad_enabled = True
            sub: fx.GraphModule = getattr(gm, sub_node.target)
            outputs = _inline(graph, node, sub, operands)
            if not grad_enabled:
                with graph.inserting_before(node):
                    outputs = [graph.call_function(torch.ops.aten.detach.default, (o,))
                               if isinstance(o, fx.Node) else o for o in outputs]
                    for o in outputs:
                        if isinstance(o, fx.Node):
                            src = o.args[0]
                            o.meta["val"] = src.meta.get("val")
                            o.meta["nn_module_stack"] = src.meta.get("nn_module_stack", {})
            for user in list(node.users):
                if user.op == "call_function" and user.target is __import__("operator").getitem:
                    user.replace_all_uses_with(outputs[user.args[1]])
                    graph.erase_node(user)
            if node.users:
                raise PlanError(f"cannot inline higher-order op {node.name}: its tuple output is used directly")
            graph.erase_node(node)
            changed = True
    for name, child in list(gm.named_children()):
        if not any(n.op == "get_attr" and n.target == name for n in graph.nodes):
            delattr(gm, name)


def _inline(graph: fx.Graph, at: fx.Node, sub: fx.GraphModule, operands: list) -> list:
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, value in zip(placeholders, operands):
        env[ph] = value
    outputs = []
    with graph.inserting_before(at):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = [env[o] if isinstance(o, fx.Node) else o for o in n.args[0]]
                break
            new = graph.node_copy(n, lambda x: env[x])
            if not new.meta.get("nn_module_stack"):
                new.meta["nn_module_stack"] = at.meta.get("nn_module_stack", {})
            env[n] = new
    return outputs


def _record_module_paths(graph: fx.Graph) -> None:
    """tf['module'] = FQN of the innermost user module a node came from ('' for the top)."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = ""
        if stack:
            path = list(stack.values())[-1][0]
        path = path.removeprefix("L['self'].").removeprefix("model")
        path = path.lstrip(".")
        tf(node)["module"] = _normalize_module_path(path)


def _normalize_module_path(path: str) -> str:
    # nn_module_stack keys look like "h.0.attn" or "h[0].attn" or "getattr(L['self'].h, '0')".
    import re
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"getattr\((.*?), '(\w+)'\)", r"\1.\2", path)
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.strip(".").removeprefix("model.") if path != "model" else ""
