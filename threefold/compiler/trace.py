"""Front end: an unmodified nn.Module (plus its loss) -> the first stage, `Traced`, over ATen ops.

We use torch.export in non-strict mode, which gives the training IR: ATen ops that autograd
can differentiate (aten.linear, aten.layer_norm, ...), every node with a fake tensor in
meta["val"], parameters and buffers lifted to placeholders. Models on the meta device trace
without allocating memory. After export we
  * wrap the loss into the graph (when loss_fn is given), so its output is a scalar loss;
  * map placeholders to canonical FQNs and merge tied parameters into one placeholder;
  * inline grad-mode / autocast higher-order ops (their no_grad outputs get a detach).
"""
from __future__ import annotations

import contextlib
import inspect
import io
import operator
import logging
import os
import re
import sys
import time
import traceback
from typing import Callable

import torch
from torch.autograd.function import _SingleLevelFunction
import torch.fx as fx
from torch.export.graph_signature import InputKind

from threefold.compiler.autocast_regions import (AUTOCAST_HOP, GRAD_HOP, disabled_region_ops, hop_arguments,
                                                 make_casts_explicit, mark_region)
from threefold.compiler.eager_loss import add_eager_loss
from threefold.compiler.graph_cleanup import drop_empty_cat_inputs, drop_identity_inplace
from threefold.ir.program import TensorMeta, tf
from threefold.ir.stages import Traced
from threefold.errors import PlanError
from threefold.model_loss import model_loss
from threefold.model_state import buffer_tables_kept
from threefold.plan import Plan
from threefold.runtime.output_tree import describe


class _ModelWithLoss(torch.nn.Module):
    """Puts the loss in the graph: forward(*inputs, target) -> loss_fn(model(*inputs), target).

    With a loss it also returns the model's own tensor outputs after the loss, so the graph
    knows which values they are (`pm(x)` returns them); _to_program keeps only the loss as
    the graph's output and records their names (`model_outputs`)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, find_own_loss: bool = True):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.find_own_loss = find_own_loss
        # the structure of the model's return value (runtime/output_tree.py), recorded
        # while export runs forward; through a closure, since export restores the module's
        # attributes (a dict set here comes back as the copy it took before)
        recorded: dict = {}
        self.record_output = lambda out: recorded.update(output_tree=describe(out))
        self.output_tree = lambda: recorded.get("output_tree")
        # no loss_fn: whether the model returned its own loss (threefold/model_loss.py)
        self.record_own_loss = lambda found: recorded.update(own_loss=found)
        self.own_loss = lambda: recorded.get("own_loss", False)

    def forward(self, *args):
        if self.loss_fn is None:
            out = self.model(*args)
            self.record_output(out)
            loss = model_loss(out, type(self.model).__name__) if self.find_own_loss else None
            self.record_own_loss(loss is not None)
            if loss is None:
                return out
            return (loss, *self._marks(out))
        *inputs, target = args
        out = self.model(*inputs)
        self.record_output(out)
        marks = self._marks(out)
        loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor):   # not one loss tensor: _to_program says so
            return loss
        return (loss, *marks)

    @staticmethod
    def _marks(out) -> list:
        # an alias of each output, taken before the loss runs: the loss may hand a tensor
        # back as itself (broadcast_tensors), which would make the trace name it after the
        # loss op; _to_program reads each alias's input and drops the aliases
        return [torch.ops.aten.alias.default(t) for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor)]


def trace(model: torch.nn.Module, inputs: tuple, target=None, loss_fn: Callable | None = None,
          plan: Plan | None = None, own_loss: bool = False) -> Traced:
    """Export `model` (with `loss_fn` when given) on example `inputs` to a Traced stage.
    `own_loss` (training without a loss_fn: parallelize, train, check): a loss the model
    returns itself (threefold/model_loss.py) becomes the graph's loss; otherwise the
    model's outputs stay the graph's outputs, as forward-only users expect."""
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"cannot trace a {type(model).__name__}: pass a torch.nn.Module")
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    has_loss = loss_fn is not None
    if has_loss and target is None:
        raise PlanError(f"{type(model).__name__}: loss_fn was given but no target: pass the example target too")
    args = inputs + ((target,) if has_loss else ())
    wrapper = _ModelWithLoss(model, loss_fn, find_own_loss=own_loss)
    plan = plan or Plan()
    if has_loss and plan.loss == "eager":
        return _trace_eager_loss(model, inputs, target, loss_fn, plan, "loss=eager")
    try:
        ep = _export(wrapper, args, type(model).__name__)
    except PlanError as exc:
        if not has_loss:
            raise
        # the loss may be what export cannot trace (CTC): trace the model alone and run the
        # loss eagerly on the last stage; if the model alone fails too, that error is raised
        first = str(exc).split("; try:")[0]
        return _trace_eager_loss(model, inputs, target, loss_fn, plan, f"torch.export: {first}")
    start = time.perf_counter()
    own_loss = not has_loss and wrapper.own_loss()   # the model returned its loss itself
    prog = _to_program(ep, model, wrapper, len(inputs), has_loss or own_loss, plan, takes_target=has_loss)
    prog = prog.evolve(output_tree=wrapper.output_tree())   # pm(x) returns this structure
    # names, ties, inlining
    return prog.evolve(pass_log=prog.pass_log + (("to_program", time.perf_counter() - start),))


def _trace_eager_loss(model, inputs: tuple, target, loss_fn, plan, why: str) -> Traced:
    """The model traced alone, its graph ended by an eager call of `loss_fn` (compiler/eager_loss.py)."""
    name = type(model).__name__
    wrapper = _ModelWithLoss(model, None, find_own_loss=False)
    ep = _export(wrapper, inputs, name)      # the model alone fails too: that is the real error
    prog = _to_program(ep, model, wrapper, len(inputs), False, plan)
    return add_eager_loss(prog, wrapper, name, len(inputs), target, loss_fn, why)


def _export(wrapper: torch.nn.Module, args: tuple, name: str):
    start = time.perf_counter()
    # On failure export logs and prints partial graphs to stderr, which would bury our
    # one-line error: hold its stderr and log output back, and pass them on only on success.
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)
    held = io.StringIO()
    custom: list[tuple[type, str]] = []
    try:
        with contextlib.redirect_stderr(held), _recording_custom_functions(wrapper, custom), \
                buffer_tables_kept(wrapper):   # PaLM's cached mask: no fake tensor left in the model
            ep = torch.export.export(wrapper, args, strict=False)
    except PlanError:
        raise
    except Exception as exc:  # export raises many types; all mean "cannot trace"
        raise PlanError(export_error_message(name, exc)) from None
    finally:
        torch_log.setLevel(level)
    checked: dict = {}
    custom = [(cls, where) for cls, where, spec in custom
              if not checked.setdefault((cls, repr(spec)), _backward_matches(cls, spec))]
    if custom:
        cls, where = custom[0]
        raise PlanError(f"{name}: custom autograd.Function {cls.__qualname__} (called in module {where!r}) "
                        "has its own backward, which torch.export does not keep: the compiled model would "
                        "differentiate its forward instead (a straight-through round would get zero "
                        "gradients); write it with differentiable torch ops, e.g. x + (torch.round(x) - x)"
                        ".detach() for a straight-through estimator")
    if held.getvalue():
        sys.stderr.write(held.getvalue())
    ep._threefold_export_seconds = time.perf_counter() - start
    return ep


@contextlib.contextmanager
def _recording_custom_functions(wrapper: torch.nn.Module, found: list):
    """While export runs forward, record every autograd.Function outside torch that the
    model applies, with the module that called it: export inlines a Function's forward and
    drops its backward, so the gradient would silently differ from the user's."""
    modules = {id(m): "" if n == "model" else _strip(n) for n, m in wrapper.named_modules()}
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not (cls.__module__ or "").startswith("torch"):
            frame, where = sys._getframe(1), "<top>"
            while frame is not None:
                owner = frame.f_locals.get("self")
                if id(owner) in modules:
                    where = modules[id(owner)] or "<top>"
                    break
                frame = frame.f_back
            spec = [(tuple(int(d) for d in a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                    for a in args]
            found.append((cls, where, spec))
        return original.__func__(cls, *args, **kwargs)
    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


class _Ctx:
    """Stands in for autograd's ctx when a Function's forward runs as plain ops."""
    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *a):
        pass

    def mark_non_differentiable(self, *a):
        pass

    def set_materialize_grads(self, value):
        pass


def _backward_matches(cls: type, spec: list) -> bool:
    """Does the Function's own backward equal autograd's derivative of its forward (what
    the traced graph computes) on random inputs of the traced shapes? A Function written
    only for speed or memory (a hand-derived GELU backward) passes; a straight-through or
    gradient-scaling one does not."""
    try:
        gen = torch.Generator().manual_seed(0)

        def make():
            out = []
            for a in spec:
                if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype):
                    shape, dtype = a
                    if dtype.is_floating_point:
                        out.append((torch.randn(shape, generator=gen, dtype=torch.float64) * 2).requires_grad_())
                    elif dtype == torch.bool:
                        out.append(torch.rand(shape, generator=gen) > 0.5)
                    else:
                        out.append(torch.zeros(shape, dtype=dtype))
                else:
                    out.append(a)
            return out
        xs = make()
        floats = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        ctx = _Ctx()
        ctx.needs_input_grad = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
        with torch.enable_grad():
            mine = cls.apply(*xs)
            ys = cls.forward(*xs) if _has_setup_context(cls) else cls.forward(ctx, *xs)
        mine = [t for t in (mine if isinstance(mine, (tuple, list)) else [mine]) if isinstance(t, torch.Tensor)]
        ys = [t for t in (ys if isinstance(ys, (tuple, list)) else [ys]) if isinstance(t, torch.Tensor)]
        pairs = [(m, y) for m, y in zip(mine, ys) if m.requires_grad and m.is_floating_point()]
        cots = [torch.randn(m.shape, generator=gen, dtype=m.dtype) for m, _ in pairs]
        g1 = torch.autograd.grad([m for m, _ in pairs], floats, cots, allow_unused=True)
        g2 = torch.autograd.grad([y for _, y in pairs], floats, cots, allow_unused=True) \
            if all(y.requires_grad for _, y in pairs) else [None] * len(floats)
        for a, b in zip(g1, g2):
            a = torch.zeros(()) if a is None else a
            b = torch.zeros(()) if b is None else b
            if not torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-6):
                return False
        return bool(pairs)
    except Exception:   # cannot check it: refuse it
        return False


def _has_setup_context(cls: type) -> bool:
    return getattr(cls, "setup_context", None) is not _SingleLevelFunction.setup_context and \
        cls.setup_context is not _SingleLevelFunction.setup_context


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_error_message(name: str, exc: BaseException) -> str:
    """One line: the model, the construct export rejected (source line), and what to try."""
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else type(exc).__name__
    where = _user_frame(exc, text)
    lowered = text.lower()
    if "data-dependent" in lowered or "guardondatadependent" in type(exc).__name__.lower():
        what = "data-dependent control flow (a Python branch or .item() on a tensor's value)"
        fix = ("compute both branches and pick with torch.where, use torch.cond, "
               "or move the check out of forward")
    elif "use_cache" in lowered or "cache" in type(exc).__name__.lower():
        what = "a key/value cache object"
        fix = "build the model with use_cache=False"
    else:
        what = f"{type(exc).__name__}: {first[:200]}"
        fix = ("make forward free of data-dependent Python control flow and .item()/.tolist() calls, "
               "pass plain tensors as inputs, and for Hugging Face models set use_cache=False")
    at = f" at {where}" if where else ""
    detail = f" ({first[:160]})" if not what.endswith(first[:200]) else ""
    return f"cannot trace {name}: torch.export rejected {what}{at}{detail}; try: {fix}"


def _user_frame(exc: BaseException, text: str) -> str:
    """`file:line `code`` of the model code export stopped at, or '' when unknown."""
    m = re.search(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in \w+\s*\n\s*(.+)', text)
    if m:
        return f"{os.path.basename(m.group(1))}:{m.group(2)} `{m.group(3).strip()}`"
    frames = []
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames = traceback.extract_tb(e.__traceback__) + frames
        e = e.__cause__ or e.__context__
    user = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _OUR_DIR, "<"))]
    if not user:
        return ""
    f = user[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f"{os.path.basename(f.filename)}:{f.lineno}{code}"


def _to_program(ep, model, wrapper, num_model_inputs: int, has_loss: bool, plan: Plan,
                takes_target: bool = True) -> Traced:
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
            if not params[fqn].requires_grad:  # frozen: stays frozen (no grad, no sync)
                ann["frozen"] = True
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

    _rename_placeholders(graph, _input_names(model, num_model_inputs, has_loss and takes_target))
    input_names = [n.name for n in graph.nodes if n.op == "placeholder" and tf(n)["kind"] == "input"]
    _inline_higher_order_ops(gm, plan)
    drop_empty_cat_inputs(graph)   # HF caches' torch.tensor([]) starts (graph_cleanup.py)
    drop_identity_inplace(graph)   # x.mul_(1) on a parameter (HF RWKV's rescale in training)
    _record_module_paths(graph)
    out_node = next(n for n in graph.nodes if n.op == "output")
    model_outputs, model_output_meta = [], []
    if has_loss and len(out_node.args[0]) > 1 and all(  # (loss, *model outputs): keep the loss
            isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) for v in out_node.args[0]):
        loss, *values = out_node.args[0]
        out_node.args = ((loss,),)
        values = [v.args[0] if v.target is torch.ops.aten.alias.default else v for v in values]
        model_outputs = [v.name for v in values]
        model_output_meta = [TensorMeta.of(v.meta["val"]) for v in values]
    graph.eliminate_dead_code()
    gm.recompile()
    alive = {n.name for n in graph.nodes}   # an output the loss does not read is gone now
    model_outputs = [n if n in alive else None for n in model_outputs]

    outs = out_node.args[0]
    output_meta = [TensorMeta.of(o.meta["val"]) for o in outs if isinstance(o, fx.Node)
                   and isinstance(o.meta.get("val"), torch.Tensor)]
    if has_loss and (len(outs) != 1 or output_meta[0].numel != 1):
        what = "loss_fn must return" if takes_target else "the loss the model returns must be"
        raise PlanError(f"{type(model).__name__}: {what} one scalar tensor, got {len(outs)} outputs")
    return Traced(name=type(model).__name__, gm=gm, plan=plan, state=state, ties=ties,
                  input_names=tuple(input_names), num_model_inputs=num_model_inputs,
                  has_loss=has_loss, output_meta=tuple(output_meta),
                  model_outputs=tuple(model_outputs), model_output_meta=tuple(model_output_meta),
                  pass_log=(("export", getattr(ep, "_threefold_export_seconds", 0.0)),))


def _input_names(model: torch.nn.Module, num_model_inputs: int, has_loss: bool) -> list[str]:
    """User input names: the model's forward parameters, then `target` (export says args_0...)."""
    names: list[str] = []
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if len(names) == num_model_inputs:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}_{i}" for i in range(num_model_inputs - len(names))]
    names += [f"input_{i}" for i in range(len(names), num_model_inputs)]
    return names + (["target"] if has_loss else [])


def _rename_placeholders(graph: fx.Graph, input_names: list[str]) -> None:
    """Readable placeholder names: p_<fqn> for parameters, b_<fqn> for buffers, the forward's
    argument names for user inputs (export names them p_model_..., args_0, ...)."""
    prefix = {"param": "p_", "buffer": "b_"}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        ann = tf(node)
        if ann["kind"] == "input":
            node._rename(input_names[ann["input_index"]])
        else:
            node._rename(prefix[ann["kind"]] + re.sub(r"\W", "_", ann["fqn"]))


def _strip(target: str) -> str:
    return target[len("model."):] if target.startswith("model.") else target


def _inline_higher_order_ops(gm: fx.GraphModule, plan: Plan | None = None) -> None:
    """Replace set_grad_enabled / autocast wrappers by their body's nodes.

    A no_grad region's outputs get an aten.detach so gradients stop there, as they did in
    the model. An autocast region's casts become explicit nodes (compiler/autocast_regions.py).
    """
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (GRAD_HOP, AUTOCAST_HOP):
                continue
            args = hop_arguments(node)
            sub_node, operands = args["wrapped_func"], list(args["args"])
            grad_enabled = args["enable_grad"] if node.target is GRAD_HOP else True
            sub: fx.GraphModule = getattr(gm, sub_node.target)
            outputs, inlined = _inline(graph, node, sub, operands)
            if node.target is AUTOCAST_HOP:
                mark_region(inlined, args)
            if not grad_enabled:
                _detach_written_values(graph, inlined)
                # an operand written in place under no_grad (`w.mul_(s)`) is still the tensor
                # it was, gradients included: its later uses read it, not a detached alias
                with graph.inserting_before(node):
                    outputs = [graph.call_function(torch.ops.aten.detach.default, (o,))
                               if isinstance(o, fx.Node) and _inplace_root(o) not in operands else o
                               for o in outputs]
                    for o in outputs:
                        if isinstance(o, fx.Node):
                            src = o.args[0]
                            o.meta["val"] = src.meta.get("val")
                            o.meta["nn_module_stack"] = src.meta.get("nn_module_stack", {})
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    user.replace_all_uses_with(outputs[user.args[1]])
                    graph.erase_node(user)
            if node.users:
                raise PlanError(f"cannot inline higher-order op {node.name}: its tuple output is used directly")
            graph.erase_node(node)
            changed = True
    for name, child in list(gm.named_children()):
        if not any(n.op == "get_attr" and n.target == name for n in graph.nodes):
            delattr(gm, name)
    kept = disabled_region_ops(graph)
    if kept and plan is not None and plan.dtype != "fp32":
        raise PlanError(f"plan dtype={plan.dtype}: the model keeps a region out of autocast "
                        f"(torch.autocast(enabled=False), around {kept[0].name}), which the plan's chunk-wide "
                        "autocast would not keep; use dtype=fp32 and put the model's forward under its own "
                        "torch.autocast")
    make_casts_explicit(graph)


def _inplace_root(node: fx.Node) -> fx.Node:
    """The value a chain of in-place ops (`x.mul_(a).add_(b)`) writes into."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target._schema.name.endswith("_") and node.args \
            and isinstance(node.args[0], fx.Node) and node.target._schema.arguments[0].is_write:
        node = node.args[0]
    return node


def _detach_written_values(graph: fx.Graph, region: list[fx.Node]) -> None:
    """In a no_grad region, what an in-place op writes (`buf.mul_(0.9).add_(x.mean())`)
    reaches its destination without a graph: its value operands get an aten.detach.

    The destination keeps its identity (see above), so it must not gain an autograd history
    from the write either: a buffer would carry the first step's graph into the next one
    ("backward through the graph a second time") and pass gradients into the batch that
    eager training never sees."""
    for node in region:
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target._schema.arguments
                and target._schema.arguments[0].is_write):
            continue
        with graph.inserting_before(node):
            def detach(a):
                val = a.meta.get("val") if isinstance(a, fx.Node) else None
                if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
                    return a
                d = graph.call_function(torch.ops.aten.detach.default, (a,))
                d.meta["val"] = val
                d.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
                return d
            node.args = (node.args[0], *fx.node.map_arg(tuple(node.args[1:]), detach))
            node.kwargs = fx.node.map_arg(dict(node.kwargs), detach)


def _inline(graph: fx.Graph, at: fx.Node, sub: fx.GraphModule, operands: list) -> tuple[list, list]:
    """The body of `sub` copied before `at`: (its outputs, the nodes copied)."""
    env: dict[fx.Node, object] = {}
    copied: list[fx.Node] = []
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
            if n.op == "get_attr":   # a nested region's body: it moves up to the outer module
                gm = graph.owning_module
                name = _free_attr_name(gm, n.target)
                setattr(gm, name, getattr(sub, n.target))
                new = graph.get_attr(name)
                new.meta.update(n.meta)
            else:
                new = graph.node_copy(n, lambda x: env[x])
            copied.append(new)
            if not new.meta.get("nn_module_stack"):
                new.meta["nn_module_stack"] = at.meta.get("nn_module_stack", {})
            env[n] = new
    return outputs, copied


def _free_attr_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _record_module_paths(graph: fx.Graph) -> None:
    """tf['module'] = FQN of the innermost user module a node came from ('' for the top)."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        tf(node)["module"] = _normalize_module_path(path)


def _normalize_module_path(path: str) -> str:
    """The user model's FQN of a module path from nn_module_stack.

    Paths look like "model.h.0.attn", "model.h[0].attn" or "getattr(L['self'].model.h, '0')";
    the leading "model" is our _ModelWithLoss wrapper's attribute, which we drop.
    """
    path = path.replace("L['self'].", "").replace("L['self']", "")
    path = re.sub(r"getattr\((.*?), '(\w+)'\)", r"\1.\2", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
    if path == "model":
        return ""
    return path.removeprefix("model.")
