"""Zero-bubble B/W split written out per op: B computes the input gradient with the op's own
backward kernel, W the weight gradients, and neither re-enters autograd.

runtime/weight_grad.deferred tries these first; an op none of them matches takes the
generic path (its local autograd graph, differentiated twice). The generic path costs
1.6-1.9x the fused backward on a layer norm or an embedding (two autograd calls per op,
a graph built in the forward; bench/zero_bubble_split.py), which on a small model is a few
percent of a chunk's backward. Each rule below applies only where its written-out gradient
is exactly the fused one:

  * the weight operands are trainable parameters themselves (not values computed from
    them: W would have to walk that computation), of the activation's dtype (no promotion),
  * outside autocast (whose casts belong to the op's graph), no keyword arguments.

The parameters are held as themselves, not through saved-tensor hooks (a hook's unpacked
copy would be another tensor, and W's .grad would land on it); activations and statistics
go through save_for_backward, so memory counters and sequence-parallel shards see them.
Each Function takes the weights as inputs (their gradient None in B) so that B reaches the
op even when no activation operand needs a gradient (an embedding's ids).

    rule               B (input gradient)                 W (weight gradients)
    linear(x, w, b)    gy @ w                             gy^T x, sum(gy)
    addmm(b, x, w)     gy @ w^T                           x^T gy, sum(gy)
    layer_norm         native_layer_norm_backward [1,0,0] the same kernel, mask [0,1,1]
    embedding(w, ids)  (none)                             embedding_dense_backward
    mul(x, w)          sum_to(gy * w)                     sum_to(gy * x)
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """p.grad += g (the first one taken as it is, as autograd's AccumulateGrad does)."""
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


def _whole(module, weights) -> None:
    """zero=3: a parameter freed after the forward is gathered again before B reads it."""
    needs_whole = getattr(module, "needs_whole", None)
    if needs_whole is not None:
        for w in weights:
            if w is not None:
                needs_whole(w)


class DeferredW:
    """W of one written-out op: a closure over what B kept."""
    __slots__ = ("fn", "args")

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def run(self) -> None:
        self.fn(*self.args)


# -- linear and addmm ---------------------------------------------------------------------

def _linear_w(x, gy, weight, bias) -> None:
    gy2 = gy.reshape(-1, gy.shape[-1])
    accumulate(weight, gy2.t().mm(x.reshape(-1, x.shape[-1])))
    if bias is not None:
        accumulate(bias, gy2.sum(0))


class _WeightOp(torch.autograd.Function):
    """A GEMM with a weight and a bias: B returns the input's gradient now, W is stashed.
    Subclasses name the forward op (`run`), the input gradient (`grad_input`) and W (`w`)."""

    @classmethod
    def forward(cls, ctx, x, weight, bias, stash, module):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.stash, ctx.module = weight, bias, stash, module
        return cls.run(x, weight, bias)

    @classmethod
    def backward(cls, ctx, gy):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        _whole(ctx.module, (weight,))
        ctx.stash.append(DeferredW(cls.w, x, gy, weight, bias))
        ctx.weight = ctx.bias = ctx.stash = ctx.module = None
        return (cls.grad_input(gy, weight) if ctx.needs_input_grad[0] else None), None, None, None, None


class _Linear(_WeightOp):
    run = staticmethod(lambda x, weight, bias: aten.linear.default(x, weight, bias))
    grad_input = staticmethod(lambda gy, weight: gy.matmul(weight))
    w = staticmethod(_linear_w)


def _addmm_w(x, gy, weight, bias) -> None:
    accumulate(weight, x.t().mm(gy))
    accumulate(bias, gy.sum_to_size(bias.shape))


class _Addmm(_WeightOp):
    run = staticmethod(lambda x, weight, bias: aten.addmm.default(bias, x, weight))
    grad_input = staticmethod(lambda gy, weight: gy.mm(weight.t()))
    w = staticmethod(_addmm_w)


# -- layer norm ---------------------------------------------------------------------------

def _layer_norm_w(module, gy, x, shape, mean, rstd, weight, bias) -> None:
    _whole(module, (weight, bias))   # the kernel reads gamma (and beta) even for their own gradients
    _, gw, gb = aten.native_layer_norm_backward.default(gy, x, shape, mean, rstd, weight, bias,
                                                        [False, True, bias is not None])
    accumulate(weight, gw)
    if bias is not None:
        accumulate(bias, gb)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, stash, module):
        out, mean, rstd = aten.native_layer_norm.default(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd)
        ctx.weight, ctx.bias, ctx.shape, ctx.stash, ctx.module = weight, bias, shape, stash, module
        return out

    @staticmethod
    def backward(ctx, gy):
        x, mean, rstd = ctx.saved_tensors
        weight, bias, shape = ctx.weight, ctx.bias, ctx.shape
        _whole(ctx.module, (weight, bias))
        ctx.stash.append(DeferredW(_layer_norm_w, ctx.module, gy, x, shape, mean, rstd, weight, bias))
        ctx.weight = ctx.bias = ctx.stash = ctx.module = None
        gx = None
        if ctx.needs_input_grad[0]:
            gx = aten.native_layer_norm_backward.default(gy, x, shape, mean, rstd, weight, bias,
                                                         [True, False, False])[0]
        return gx, None, None, None, None, None, None


# -- embedding ----------------------------------------------------------------------------

def _embedding_w(gy, ids, weight, padding_idx, scale) -> None:
    accumulate(weight, aten.embedding_dense_backward.default(gy, ids, weight.shape[0], padding_idx, scale))


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale, stash, module):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.scale, ctx.stash = weight, padding_idx, scale, stash
        ctx.module = module
        return aten.embedding.default(weight, ids, padding_idx, scale)

    @staticmethod
    def backward(ctx, gy):
        (ids,) = ctx.saved_tensors     # B reads no weight: nothing to gather
        ctx.stash.append(DeferredW(_embedding_w, gy, ids, ctx.weight, ctx.padding_idx, ctx.scale))
        ctx.weight = ctx.stash = ctx.module = None
        return None, None, None, None, None, None


# -- mul by a parameter -------------------------------------------------------------------

def _mul_w(gy, x, weight) -> None:
    accumulate(weight, (gy * x).sum_to_size(weight.shape))


class _Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, stash, module):
        ctx.save_for_backward(x)
        ctx.weight, ctx.stash, ctx.module = weight, stash, module
        return aten.mul.Tensor(x, weight)

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        _whole(ctx.module, (weight,))
        ctx.stash.append(DeferredW(_mul_w, gy, x, weight))
        ctx.weight = ctx.stash = ctx.module = None
        gx = (gy * weight).sum_to_size(x.shape) if ctx.needs_input_grad[0] else None
        return gx, None, None, None


# -- matching -----------------------------------------------------------------------------

def _params_are(operands, params) -> bool:
    """The weight operands (None: absent) are exactly the trainable parameters `params`."""
    present = [o for o in operands if o is not None]
    return (len(present) == len(params) and all(any(o is p for p in params) for o in present)
            and all(p.requires_grad for p in params))


def _act(x, *weights) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and all(
        w is None or w.dtype == x.dtype for w in weights)


def written_out(op, args: tuple, kwargs: dict, params: tuple, stash: list, module):
    """The op run with a written-out B/W split, or None where no rule applies (module doc)."""
    if kwargs or torch.is_autocast_enabled():
        return None
    n = len(args)
    if op is aten.linear.default and n in (2, 3):
        x, w, b = args[0], args[1], args[2] if n == 3 else None
        if _params_are((w, b), params) and _act(x, w, b):
            return _Linear.apply(x, w, b, stash, module)
    elif op is aten.addmm.default and n == 3:
        b, x, w = args
        if _params_are((w, b), params) and _act(x, w, b) and x.dim() == 2:
            return _Addmm.apply(x, w, b, stash, module)
    elif op is aten.layer_norm.default and 3 <= n <= 6:
        x, shape = args[0], args[1]
        w, b = args[2], args[3] if n > 3 else None
        eps = args[4] if n > 4 else 1e-5
        if w is not None and _params_are((w, b), params) and _act(x, w, b):
            return _LayerNorm.apply(x, w, b, list(shape), eps, stash, module)
    elif op is aten.embedding.default and 2 <= n <= 4:
        w, ids = args[0], args[1]
        padding_idx, scale = (args[2] if n > 2 else -1), (args[3] if n > 3 else False)
        if _params_are((w,), params) and w.is_floating_point() and not ids.is_floating_point():
            return _Embedding.apply(w, ids, padding_idx, scale, stash, module)
    elif op is aten.mul.Tensor and n == 2:
        a, b = args
        for x, w in ((a, b), (b, a)):
            if isinstance(w, torch.Tensor) and _params_are((w,), params) and _act(x, w) and x is not w:
                return _Mul.apply(x, w, stash, module)
    return None
