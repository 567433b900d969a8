"""Derive from the loss graph how the loss combines batch rows, so that microbatch and
data-parallel partial results combine into exactly the single-process loss and gradients.

The graph is traced on one microbatch. Its loss is `scale(R(rows))`: a final reduction R
(cross-entropy / nll / mse / ... with reduction=mean or sum, aten.mean, aten.sum) under a
chain of linear scale ops (mul/div by a constant, neg, dtype casts). We rewrite R into its
sum form, so the chunk's output is a *numerator* (a sum over this microbatch's rows), and
record the *denominator* in `prog.loss_form`:

  {"kind": "graph"}     per microbatch, a function of user inputs only (the number of
                        targets != ignore_index, or their class weights' sum); its graph is
                        `prog.loss_denominator` and codegen writes it as a method
  {"kind": "const", "value": c}  per microbatch, a constant (numel for mean over elements)
  {"kind": "one"}       global denominator 1 (a sum-reduced loss)

The runtime computes the global denominator D (the sum over every microbatch of every dp
rank, or 1) before the step's first backward, seeds each microbatch's backward with 1/D and
reports sum(numerators) / D. `loss=microbatch_mean` (plan) keeps the traced loss as it is
with const 1 per microbatch: the mean of microbatch losses.
Where no exact combination exists (a nonlinear function of a mean, two terms with their own
denominators, a denominator that depends on parameters) and m*dp > 1, a PlanError names the
op and the options.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.ir.program import is_eager_loss
from threefold.ir.program import tf
from threefold.ir.stages import Draft, Traced
from threefold.errors import PlanError
from threefold.passes.cp_denominator import whole_along
from threefold.ops.families import (COPIES, ELEMENT_MEAN_LOSSES, RESHAPES, SCALINGS, TARGET_COUNTED_LOSSES,
                                    UNIT_DIMS)

aten = torch.ops.aten

MEAN, SUM, NONE = 1, 2, 0  # at::Reduction
_PASS_THROUGH = COPIES | RESHAPES | UNIT_DIMS   # detach is not linear but has no gradient either
_FIX = ("set loss=microbatch_mean in the plan (the mean of per-microbatch losses), or use m=1 "
        "and dp=1")


def split_fix(plan) -> str:
    """The options a user has. Under ep=N the batch is always split (ep divides dp, N > 1),
    so m=1, dp=1 is not one; the usual culprit there is a router load-balancing loss,
    E x sum_e f_e x P_e: a product of two means over every token (docs/design.md)."""
    if getattr(plan, "ep", 1) == 1:
        return _FIX
    return (f"ep={plan.ep} always splits the batch (ep divides dp), and a router load-balancing loss "
            "(a product of two batch means) never splits exactly: set loss=microbatch_mean (each "
            "rank and microbatch balances its own tokens), or train without the aux loss")


@stage_pass(needs=Traced, guarantees=("loss_combined",))
def loss_form(stage: Traced) -> Traced:
    """Needs: a traced graph whose output is the loss. Guarantees: the output is this
    microbatch's numerator and loss_form says how to combine it (see module doc)."""
    if not stage.has_loss:
        return stage.evolve()
    if stage.plan.loss == "microbatch_mean":
        return stage.evolve(loss_form={"mode": "microbatch_mean", "denominator": {"kind": "const", "value": 1}})
    parts = stage.plan.dp * stage.plan.microbatches * stage.plan.cp   # cp ranks hold different tokens
    if parts == 1:  # one microbatch on one replica: nothing to combine, keep the loss as traced
        return stage.evolve(loss_form={"mode": "whole", "denominator": {"kind": "const", "value": 1}})
    prog = stage.draft()   # the rewrite below works on a copy of the graph
    node, divisor = final_op(prog.graph)
    try:
        form = _rewrite(prog, node, divisor)
    except _NotSeparable as exc:
        raise PlanError(f"{prog.name}: the loss is not a sum or mean over batch rows ({exc}), so "
                        f"the {parts} microbatch/dp partial losses cannot be combined exactly; "
                        f"{split_fix(stage.plan)}") from None
    form["mode"] = "exact"
    form["module"] = tf(node).get("module", "")
    whole = whole_along(prog.loss_denominator, prog.graph, stage.plan, stage.seq_tail)   # cp: a shift of the labels
    if whole:
        form["whole_along"] = whole
    prog.loss_form = form
    prog.gm.recompile()
    return prog.freeze()


class _NotSeparable(Exception):
    pass


def final_op(graph: fx.Graph) -> tuple[fx.Node, float]:
    """The loss's last op under its chain of scale ops (mul/div by a number, neg, casts and
    views of the scalar), and the product of the divisors on the way."""
    out = next(n for n in graph.nodes if n.op == "output")
    node, divisor = out.args[0][0], 1.0
    while True:
        name = _name(node)
        if name in _PASS_THROUGH and _val(node).numel() == 1:
            node = node.args[0]
        elif name in SCALINGS and _is_number(node.args[1]) and isinstance(node.args[0], fx.Node):
            divisor *= node.args[1] if name == "div" else 1.0
            node = node.args[0]
        elif name == "neg":
            node = node.args[0]
        else:
            return node, divisor


def exact_reductions(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that reduce batch rows which `loss_form` turns into an exact combination:
    the final reduction (a loss op with reduction mean/sum, a full mean or sum) and, for
    `num / den`, the numerator's reduction and everything the denominator computes
    (loss_form itself checks that the denominator reads user inputs only)."""
    node, _ = final_op(graph)
    return _exact_at(node)


def _exact_at(node: fx.Node) -> set[fx.Node]:
    name = _name(node)
    if name in TARGET_COUNTED_LOSSES or name in ELEMENT_MEAN_LOSSES:
        return {node}
    if name in ("mean", "sum") and _val(node).numel() == 1:
        return {node}
    if name == "div" and isinstance(node.args[1], fx.Node) and isinstance(node.args[0], fx.Node) \
            and _val(node.args[1]).numel() == 1:
        return _exact_at(node.args[0]) | _ancestors([node.args[1]]) | {node}
    return set()


def _rewrite(prog: Draft, node: fx.Node, divisor: float) -> dict:
    if is_eager_loss(node):
        return _eager_form(prog, node)
    name = _name(node)
    op = f"aten.{name}"
    if name in TARGET_COUNTED_LOSSES or name in ELEMENT_MEAN_LOSSES:
        idx = _reduction_index(node)
        reduction = _arg(node, idx, "reduction", MEAN)
        if name == "kl_div" and reduction == MEAN:
            pass  # aten kl_div's mean is over elements ('batchmean' arrives as sum / rows)
        if reduction == SUM:
            return _sum_form(prog, op, divisor)
        if reduction != MEAN:
            raise _NotSeparable(f"{op} with reduction={reduction} ends the loss")
        _set_reduction(node, idx, SUM)
        if name in TARGET_COUNTED_LOSSES:
            return _count_denominator(prog, node, op)
        numel = _broadcast_numel(node)
        return {"reduction": "mean", "op": op, "denominator": {"kind": "const", "value": numel}}
    if name == "mean" and _val(node).numel() == 1:
        x = node.args[0]
        with prog.graph.inserting_after(node):
            if node.target == aten.mean.default:
                new = prog.graph.call_function(aten.sum.default, (x,), dict(node.kwargs))
            else:
                new = prog.graph.call_function(aten.sum.dim_IntList, tuple(node.args), dict(node.kwargs))
        _take_place(node, new)
        return {"reduction": "mean", "op": op, "denominator": {"kind": "const", "value": _val(x).numel()}}
    if name == "sum" and _val(node).numel() == 1:
        return _sum_form(prog, op, divisor)
    if name == "div" and isinstance(node.args[1], fx.Node) and _val(node.args[1]).numel() == 1:
        return _ratio_form(prog, node)
    raise _NotSeparable(f"its last op before the scalar is {op} in module "
                        f"{tf(node).get('module', '') or '<top>'!r}")


def _eager_form(prog: Draft, node: fx.Node) -> dict:
    """A loss run eagerly (compiler/eager_loss.py), whose combination of rows was measured
    on the example batch: a mean becomes loss * rows over a denominator of rows."""
    key, reduction = tf(node)["eager_loss"], tf(node).get("eager_reduction")
    if reduction == "sum":
        return {"reduction": "sum", "op": key, "denominator": {"kind": "one"}}
    if reduction == "mean" and prog.micro_rows:
        node.args = (node.args[0], node.args[1], float(prog.micro_rows), *node.args[3:])
        return {"reduction": "mean", "op": key, "denominator": {"kind": "const", "value": prog.micro_rows}}
    raise _NotSeparable(f"the eager loss {key} is neither the mean nor the sum of its rows' losses "
                        f"on the example batch")


def _sum_form(prog: Draft, op: str, divisor: float) -> dict:
    """A sum over rows. Divided by a constant that is a multiple of the microbatch's row
    count it is a per-row mean written by hand (kl_div 'batchmean', `.sum() / x.size(0)`):
    export baked the microbatch size into the constant, so every microbatch counts 1."""
    rows = prog.micro_rows
    if rows and divisor != 1.0 and float(divisor).is_integer() and int(divisor) % rows == 0:
        return {"reduction": "sum/rows", "op": op, "denominator": {"kind": "const", "value": 1}}
    return {"reduction": "sum", "op": op, "denominator": {"kind": "one"}}


def _count_denominator(prog: Draft, loss: fx.Node, op: str) -> dict:
    """Targets that count: (target != ignore_index), weighted by class weights when given."""
    target = loss.args[1]
    weight = _arg(loss, 2, "weight", None)
    ignore = _arg(loss, 4, "ignore_index", -100)
    tval = _val(target)
    if tval.is_floating_point():  # class probabilities: the mean is over rows
        x = _val(loss.args[0])
        rows = x.numel() // x.shape[1] if x.dim() > 1 else 1
        if weight is not None:
            raise PlanError(f"{op} with class weights and probability targets: the combination over "
                            f"microbatches is not implemented; {_FIX}")
        return {"reduction": "mean", "op": op, "denominator": {"kind": "const", "value": rows}}
    def count(g: fx.Graph, env: dict) -> fx.Node:
        t = env[target]
        keep = g.call_function(aten.ne.Scalar, (t, ignore))
        if not isinstance(weight, fx.Node):
            return keep
        safe = g.call_function(aten.where.self, (keep, t, g.call_function(aten.zeros_like.default, (t,))))
        w = g.call_function(aten.index.Tensor, (env[weight], [safe]))
        return g.call_function(aten.mul.Tensor, (w, keep))
    needed = [target] + ([weight] if isinstance(weight, fx.Node) else [])
    prog.loss_denominator = _input_graph(prog, needed, count, loss, op)
    return {"reduction": "mean", "op": op, "denominator": {"kind": "graph"},
            "ignore_index": ignore, "weighted": weight is not None}


def _ratio_form(prog: Draft, div: fx.Node) -> dict:
    """`numerator / denominator` written by hand, e.g. `(ce * w).sum() / w.sum()`: a row sum
    over a scalar that depends on user inputs only. The division leaves the graph; the
    divisor's graph becomes the per-microbatch denominator, summed over the global batch."""
    num, den = div.args[0], div.args[1]
    inner = _rewrite(prog, num, 1.0) if isinstance(num, fx.Node) else None
    if inner is None or inner["denominator"]["kind"] != "one":
        raise _NotSeparable(f"aten.div of {inner['op'] if inner else 'a constant'} (itself a mean) by a "
                            f"tensor in module {tf(div).get('module', '') or '<top>'!r}")
    graph = _input_graph(prog, [den], lambda g, env: env[den], div, "aten.div")
    div.replace_all_uses_with(num)
    prog.graph.erase_node(div)
    _erase_unused(den)
    prog.loss_denominator = graph
    return {"reduction": "ratio", "op": inner["op"], "denominator": {"kind": "graph"}}


def _input_graph(prog: Draft, needed: list[fx.Node], build, at: fx.Node, op: str) -> fx.GraphModule:
    """A graph of user inputs only that recomputes `needed` and returns `build(g, env)`
    summed in float64: the loss's denominator for one microbatch."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    order = {n: i for i, n in enumerate(prog.graph.nodes)}
    for n in sorted(_ancestors(needed), key=order.__getitem__):
        if n.op == "placeholder":
            if tf(n)["kind"] == "param":
                raise PlanError(f"{op}: its denominator depends on parameter {tf(n)['fqn']!r}, so "
                                f"microbatch losses cannot be combined exactly; {_FIX}")
            ph = g.placeholder(n.name)
            ph.meta = {"val": n.meta.get("val"), "tf": dict(tf(n))}
            env[n] = ph
        else:
            new = g.node_copy(n, lambda a: env[a])
            new.meta = {"val": n.meta.get("val"), "tf": dict(tf(n))}
            env[n] = new
    total = g.call_function(aten.sum.default, (build(g, env),), {"dtype": torch.float64})
    g.output((total,))
    for n in g.nodes:
        if n.op == "call_function":
            n.meta.setdefault("tf", {})["module"] = tf(at).get("module", "")
    g.lint()
    return fx.GraphModule(torch.nn.Module(), g, class_name="LossDenominator")


def _erase_unused(node: fx.Node) -> None:
    """Remove `node` and the ancestors that only it used (the divisor moved to its own graph)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.op != "call_function" or n.users:
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _take_place(old: fx.Node, new: fx.Node) -> None:
    new.meta = dict(old.meta)
    new.meta["tf"] = dict(tf(old))
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def _set_reduction(node: fx.Node, idx: int, value: int) -> None:
    schema = node.target._schema
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if idx < len(args):
        args[idx] = value
    else:  # fill defaults up to the reduction argument, positionally
        for a in schema.arguments[len(args):idx]:
            if a.name in kwargs:
                args.append(kwargs.pop(a.name))
            else:
                args.append(a.default_value)
        args.append(value)
        kwargs.pop("reduction", None)
    node.args, node.kwargs = tuple(args), kwargs


def _reduction_index(node: fx.Node) -> int:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == "reduction":
            return i
    raise _NotSeparable(f"{node.target} has no reduction argument")


def _arg(node: fx.Node, idx: int, name: str, default):
    if idx < len(node.args):
        return node.args[idx]
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is not None and idx < len(schema.arguments) and schema.arguments[idx].has_default_value():
        return schema.arguments[idx].default_value
    return default


def _broadcast_numel(node: fx.Node) -> int:
    shapes = [tuple(_val(a).shape) for a in node.args[:2] if isinstance(a, fx.Node)]
    n = 1
    for s in torch.broadcast_shapes(*shapes):
        n *= int(s)
    return n


def _name(node) -> str:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        return "getitem"
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else getattr(node.target, "__name__", "")


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _is_number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)
