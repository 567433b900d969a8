"""The backward split of zero-bubble schedules at run time: B computes input gradients, W
the weight gradients B deferred.

The compiler (codegen/backward_split.py) writes every op that reads a trainable parameter
(directly, or through ops on parameters only such as a transpose) as

    y = weight_grad.deferred(self, aten.linear.default, (x, w, b), weights=(1, 2), params=(w, b))

`deferred` runs the op inside an autograd Function of its own: the op's local graph is
built on detached copies of its activation operands and on the weight operands as they are.
The Function's backward (run by the chunk's B) differentiates that local graph with
respect to the activation operands only, so autograd skips the weight-gradient kernels
(e.g. grad_output^T @ input of a linear), and appends (the op's outputs, their gradients,
its parameters) to the (chunk, microbatch)'s stash. The local graph is what W needs and
nothing else: the op's own saved tensors (a linear's input and weight; a norm's input
statistics) and the output gradient. W (`run_deferred`) differentiates all stashed local
graphs of one (chunk, microbatch) in one autograd call restricted to the parameters, which
accumulates into their .grad exactly what the fused backward would have, and frees them.

A linear on parameters (outside autocast) skips the local graph: `_LinearInputGradOnly`
computes grad_x in B and leaves (input, grad_output) for W to compute the weight's and
bias's gradients with one matmul and one sum.

With no stash (a fused schedule, inference, no grad) `deferred` is the op itself.
"""
from __future__ import annotations

import torch


class _Call:
    """One deferred op: what to run and where its W inputs go."""
    __slots__ = ("op", "args", "kwargs", "act_pos", "params", "stash")

    def __init__(self, op, args, kwargs, act_pos, params, stash):
        self.op, self.args, self.kwargs = op, args, kwargs
        self.act_pos, self.params, self.stash = act_pos, params, stash


class _InputGradOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        # tensors: the activation operands, then the parameters. The parameters are inputs
        # only so that autograd reaches this op in B even when no activation operand needs a
        # gradient (an embedding's token ids); their gradients are W's, so B returns None.
        ctx.set_materialize_grads(False)
        acts = tensors[:len(call.act_pos)]
        leaves = [a.detach().requires_grad_(a.requires_grad) for a in acts]
        args = list(call.args)
        for pos, leaf in zip(call.act_pos, leaves):
            args[pos] = leaf
        with torch.enable_grad():
            out = call.op(*args, **call.kwargs)
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else tuple(out)
        ctx.call, ctx.leaves, ctx.outs = call, leaves, outs
        results = tuple(o.detach() for o in outs)
        frozen = [r for r, o in zip(results, outs) if not o.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return results[0] if single else results

    @staticmethod
    def backward(ctx, *grads):
        call, leaves, outs = ctx.call, ctx.leaves, ctx.outs
        ctx.call = ctx.leaves = ctx.outs = None
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        input_grads: list = [None] * len(leaves)
        if pairs and wanted:
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                           retain_graph=True, allow_unused=True))
            input_grads = [next(got) if leaf.requires_grad else None for leaf in leaves]
        if pairs:
            call.stash.append((tuple(o for o, _ in pairs), tuple(g for _, g in pairs), call.params))
        return (None, *input_grads, *[None] * len(call.params))


class _LinearW:
    """W of one linear: dL/dweight = gy^T x and dL/dbias = sum(gy), written out."""
    __slots__ = ("x", "gy", "weight", "bias")

    def __init__(self, x, gy, weight, bias):
        self.x, self.gy, self.weight, self.bias = x, gy, weight, bias

    def run(self) -> None:
        gy = self.gy.reshape(-1, self.gy.shape[-1])
        _accumulate(self.weight, gy.t().mm(self.x.reshape(-1, self.x.shape[-1])))
        if self.bias is not None:
            _accumulate(self.bias, gy.sum(0))


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class _LinearInputGradOnly(torch.autograd.Function):
    """aten.linear whose backward is written out rather than re-entering autograd: B is
    grad_x = gy @ weight, W (`_LinearW`) the weight's and bias's. Most of a transformer's
    weight-gradient FLOPs are linears, and one autograd call per op in B costs more than
    the matmul at small sizes."""

    @staticmethod
    def forward(ctx, x, weight, bias, stash, module):
        # the input goes through autograd's saved-tensor hooks (memory counters, sequence
        # shards); the parameters are held as they are: W accumulates into their .grad, and
        # a hook's unpacked copy would be another tensor
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.stash, ctx.module = weight, bias, stash, module
        return torch.ops.aten.linear.default(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        needs_whole = getattr(ctx.module, "needs_whole", None)   # zero=3: gathered again if freed
        if needs_whole is not None:
            needs_whole(weight)
        ctx.stash.append(_LinearW(x, gy, weight, ctx.bias))
        ctx.weight = ctx.bias = ctx.stash = ctx.module = None
        grad_x = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


def _plain_linear(op, args, kwargs, params) -> bool:
    """aten.linear(x, weight[, bias]) on trainable parameters of x's dtype, outside autocast
    (where the op's casts are part of its graph): the written-out backward applies."""
    if op is not torch.ops.aten.linear.default or kwargs or torch.is_autocast_enabled():
        return False
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else None
    expected = (weight,) if bias is None else (weight, bias)
    return (len(params) == len(expected) and all(a is p for a, p in zip(expected, params))
            and isinstance(x, torch.Tensor) and all(p.requires_grad and p.dtype == x.dtype for p in params))


def deferred(module, op, args: tuple, kwargs: dict | None = None, *, weights: tuple[int, ...],
             params: tuple) -> object:
    """Run `op(*args, **kwargs)`; under a zero-bubble schedule its weight gradients wait for W.

    `weights`: positions in args of the weight operands (parameters, or values computed from
    parameters only); `params`: the trainable parameters behind them."""
    kwargs = kwargs or {}
    stash = getattr(module, "weight_stash", None)
    if stash is None or not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
        return op(*args, **kwargs)
    if _plain_linear(op, args, kwargs, params):
        return _LinearInputGradOnly.apply(args[0], args[1], args[2] if len(args) > 2 else None, stash, module)
    act_pos = tuple(i for i, a in enumerate(args) if i not in weights and isinstance(a, torch.Tensor))
    call = _Call(op, args, kwargs, act_pos, tuple(p for p in params if p.requires_grad), stash)
    return _InputGradOnly.apply(call, *[args[i] for i in act_pos], *call.params)


def run_deferred(stash: list) -> None:
    """W for one (chunk, microbatch): the weight gradients of every op its B deferred,
    accumulated into the parameters' .grad; frees what B kept for them."""
    if not stash:
        return
    tensors, grads, params = [], [], {}
    entries = list(stash)
    stash.clear()
    for entry in entries:
        if isinstance(entry, _LinearW):
            entry.run()
            continue
        outs, gs, ps = entry
        tensors.extend(outs)
        grads.extend(gs)
        for p in ps:
            params[id(p)] = p
    if tensors:
        torch.autograd.backward(tensors, grads, inputs=list(params.values()))
