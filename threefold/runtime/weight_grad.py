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

Linear, addmm, layer norm, embedding, and add/sub/mul with a parameter (or a value computed
from parameters only) skip the local graph (runtime/weight_grad_ops.py): B runs the op's
input-gradient kernel (mostly autograd's own node, on detached weights) and leaves what W
needs (input, output gradient, statistics) for W's weight-gradient kernels, with no
autograd call of their own.

With no stash (a fused schedule, inference, no grad) `deferred` is the op itself.
"""
from __future__ import annotations

import torch

from threefold.runtime.weight_grad_ops import DeferredW, _linear_w, written_out
from threefold.runtime.weight_grad_ops import _hooked as _hook


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


def deferred(module, op, args: tuple, kwargs: dict | None = None, *, weights: tuple[int, ...],
             params: tuple) -> object:
    """Run `op(*args, **kwargs)`; under a zero-bubble schedule its weight gradients wait for W.

    `weights`: positions in args of the weight operands (parameters, or values computed from
    parameters only); `params`: the trainable parameters behind them."""
    # (the common case first and cheapest: this runs once per deferred op per forward)
    stash = getattr(module, "weight_stash", None)
    if stash is None or not torch.is_grad_enabled():
        return op(*args, **(kwargs or {}))
    if not kwargs:
        # runtime/weight_grad_ops.py; it checks the parameters need gradients itself
        out = written_out(op, args, None, params, stash, module, weights)
        if out is not None:
            return out
    kwargs = kwargs or {}
    if not any(p.requires_grad for p in params):
        return op(*args, **kwargs)
    act_pos = tuple(i for i, a in enumerate(args) if i not in weights and isinstance(a, torch.Tensor))
    call = _Call(op, args, kwargs, act_pos, tuple(p for p in params if p.requires_grad), stash)
    return _InputGradOnly.apply(call, *[args[i] for i in act_pos], *call.params)


def run_deferred(stash: list) -> None:
    """W for one (chunk, microbatch): the weight gradients of every op its B deferred,
    accumulated into the parameters' .grad; frees what B kept for them."""
    if not stash:
        return
    tensors, grads, params = [], [], {}
    entries = stash[:]
    stash.clear()
    # Written-out W's read activations that have an autograd history: under no_grad their
    # kernels build no graph (and the gradients they leave need none). One whose weight
    # operand was computed from parameters hands back (that value, its gradient, the
    # parameters), walked with the generic entries in one autograd call below. Each entry
    # is dropped as soon as it has run: what it kept (an input, an output gradient) goes
    # back to the allocator while W goes on, not all at once at the end.
    later = []
    with torch.no_grad():
        for i, e in enumerate(entries):
            entries[i] = None
            r = e.run() if isinstance(e, DeferredW) else e
            del e
            if r is not None:
                later.append(r)
    for entry in later:
        outs, gs, ps = entry
        tensors.extend(outs)
        grads.extend(gs)
        for p in ps:
            params[id(p)] = p
    if tensors:
        torch.autograd.backward(tensors, grads, inputs=list(params.values()))


# -- straight-line entry points -----------------------------------------------------------
#
# codegen/backward_split.py writes a linear or a layer norm whose weight operands are
# trainable parameters themselves (the common case) as a call to one of these instead of
# `deferred(self, OP, (args...), weights=..., params=...)`: the op is known when the code
# is generated, so the hooked path's conditions are checked inline and the dispatch through
# `deferred` and `written_out` (5-10 us per op in the forward, against kernels of ~20 us at
# GPT-small microbatch sizes) is skipped. Anything else falls back to `deferred`, which
# applies the same rules.

_linear = torch._C._nn.linear
_hooks_default = torch._C._autograd._top_saved_tensors_default_hooks
_is_autocast = torch.is_autocast_enabled
_aten_linear = torch.ops.aten.linear.default
_aten_layer_norm = torch.ops.aten.layer_norm.default


def linear(module, x, w, b=None):
    """`aten.linear(x, w, b)`, w and b trainable parameters; its weight gradients in W."""
    stash = getattr(module, "weight_stash", None)
    if stash is None or not torch.is_grad_enabled():
        return _linear(x, w, b)
    if (x.requires_grad and w.requires_grad and x.dtype == w.dtype
            and (b is None or (b.requires_grad and b.dtype == w.dtype))
            and not _is_autocast() and _hooks_default(False) is None):
        # weight_grad_ops' hooked path, inline
        out = _linear(x, w.detach(), None if b is None else b.detach())
        return _hook(stash, out, x, _linear_w, x, w, b)
    args = (x, w) if b is None else (x, w, b)
    return deferred(module, _aten_linear, args, weights=tuple(range(1, len(args))), params=args[1:])


def layer_norm(module, x, shape, w, b=None, eps=1e-5, cudnn_enable=True):
    """`aten.layer_norm`, w (and b) trainable parameters. On the hooked path its weight
    gradients stay in B (runtime/weight_grad_ops.written_out says why): the op itself."""
    stash = getattr(module, "weight_stash", None)
    if stash is None or not torch.is_grad_enabled() or (
            x.requires_grad and w.requires_grad and x.dtype == w.dtype
            and (b is None or (b.requires_grad and b.dtype == w.dtype))
            and not _is_autocast() and _hooks_default(False) is None):
        return torch.layer_norm(x, shape, w, b, eps, cudnn_enable)
    args = (x, shape, w, b, eps, cudnn_enable)
    params = (w,) if b is None else (w, b)
    return deferred(module, _aten_layer_norm, args, weights=(2, 3) if b is not None else (2,), params=params)

