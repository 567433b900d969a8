"""Zero-bubble B/W split written out per op: B computes the input gradient with the op's own
backward kernel, W the weight gradients, and neither re-enters autograd.

runtime/weight_grad.deferred tries these first; an op none of them matches takes the
generic path (its local autograd graph, differentiated twice: 1.5-3.8x the fused backward
on a small op). Each rule applies only where its written-out gradient is exactly the fused
one:

  * the weight operands are trainable parameters themselves, of the activation's dtype (no
    promotion); add/sub/mul also take a value computed from parameters only (a position
    embedding's rows, a 1 + w scale), whose gradient W walks back through its own graph,
  * outside autocast (whose casts belong to the op's graph), no keyword arguments.

Two paths (issue 25 item 3: B + W no dearer than the fused backward):

  * hooked (where an activation operand needs a gradient and no saved-tensor hooks are
    active): the op runs as itself on *detached* weights, so autograd's own node is B and
    computes only the input gradient (its kernels skip the outputs nobody needs); a
    pre-hook on that node hands W the output gradient. No Python in B but the hook, no
    Function in the forward.
  * one autograd.Function per op (an embedding's ids need no gradient, so no node of
    autograd's would reach B; and under saved-tensor hooks: sequence-parallel shards, zero=3
    gathers and the memory counters see what the op keeps only through save_for_backward).
    The parameters are held as themselves, not through saved-tensor hooks (a hook's unpacked
    copy would be another tensor, and W's .grad would land on it). Each Function takes the
    weights as inputs (their gradient None in B) so that B reaches the op even when no
    activation operand needs a gradient.

W runs under no_grad (runtime/weight_grad.run_deferred) and adds into an existing .grad in
place where it can (addmm_ with beta 1, index_add_): the fused backward's AccumulateGrad
pays a temporary and an add_ over the whole gradient for every microbatch after the first.

    rule               B (input gradient)                 W (weight gradients)
    linear(x, w, b)    gy @ w                             .grad += gy^T x (addmm_), sum(gy)
    addmm(b, x, w)     gy @ w^T                           .grad += x^T gy (addmm_), sum(gy)
    layer_norm         native_layer_norm_backward [1,0,0] the same kernel, mask [0,1,1]
                       (hooked path: not deferred, the fused kernel in B; see written_out)
    embedding(w, ids)  (none)                             .grad.index_add_(ids, gy)
    add/sub(x, w)      sum_to(+-gy)                       sum_to(+-gy)
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


def _grad_in_place(p: torch.Tensor):
    """p.grad where a kernel may add into it in place (beats AccumulateGrad's temporary and
    add_ over the whole gradient), else None (no gradient yet, or another dtype or shape)."""
    g = p.grad
    if g is not None and g.dtype == p.dtype and g.shape == p.shape and not g.requires_grad:
        return g
    return None


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

    def run(self):
        """None, or (values computed from parameters, their gradients, those parameters)
        for runtime/weight_grad.run_deferred to walk back in one autograd call."""
        return self.fn(*self.args)


# -- linear and addmm ---------------------------------------------------------------------

def _linear_w(gy, x, weight, bias) -> None:
    gy2 = gy if gy.dim() == 2 else gy.reshape(-1, gy.shape[-1])
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    g = _grad_in_place(weight)
    if g is not None:
        g.addmm_(gy2.t(), x2)           # the GEMM adds into the gradient: no temporary
    else:
        accumulate(weight, gy2.t().mm(x2))
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
        ctx.stash.append(DeferredW(cls.w, gy, x, weight, bias))
        ctx.weight = ctx.bias = ctx.stash = ctx.module = None
        return (cls.grad_input(gy, weight) if ctx.needs_input_grad[0] else None), None, None, None, None


class _Linear(_WeightOp):
    run = staticmethod(lambda x, weight, bias: aten.linear.default(x, weight, bias))
    grad_input = staticmethod(lambda gy, weight: gy.matmul(weight))
    w = staticmethod(_linear_w)


def _addmm_w(gy, x, weight, bias) -> None:
    g = _grad_in_place(weight)
    if g is not None:
        g.addmm_(x.t(), gy)
    else:
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
    g = _grad_in_place(weight)
    if g is not None and padding_idx == -1 and not scale:
        # the kernel's own scatter-add, into the gradient: no zeroed vocab x h temporary
        g.index_add_(0, ids.reshape(-1), gy.reshape(-1, gy.shape[-1]))
    else:
        accumulate(weight, aten.embedding_dense_backward.default(gy, ids, weight.shape[0],
                                                                 padding_idx, scale))


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


# -- add, sub, mul with a weight operand -------------------------------------------------
#
# The weight operand is a parameter (RMSNorm's scale) or a value computed from parameters
# only (a position embedding's rows, a (1 + w) scale): W hands the latter its gradient
# through its own graph, batched with the generic path's entries (runtime/weight_grad.py).
# The computed value is held on ctx, not passed as an input: B must not walk its graph
# (autograd would free it before W).

def _elementwise_w(op, gy, x, w, w_first, params) -> tuple | None:
    if op is aten.mul.Tensor:
        gw = (gy * x).sum_to_size(w.shape)
    else:
        gw = gy.sum_to_size(w.shape)
        if op is aten.sub.Tensor and not w_first:
            gw = gw.neg()
    if w.grad_fn is None:
        if gw is gy and w.grad is None:
            gw = gy.clone()     # gy is also x's gradient (and maybe another W's input)
        accumulate(w, gw)
        return None
    return (w,), (gw,), params


def _elementwise_w_hooked(gy, op, x, w, w_first, params):
    return _elementwise_w(op, gy, x, w, w_first, params)


class _Elementwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, boxed_w, w_first, stash, module, *params):
        # params: inputs only so that B reaches this op (their gradient None: W's); the
        # weight operand comes boxed, as apply() makes every top-level tensor an input
        (w,) = boxed_w
        if op is aten.mul.Tensor:
            ctx.save_for_backward(x)
        ctx.op, ctx.w, ctx.w_first, ctx.stash, ctx.module = op, w, w_first, stash, module
        ctx.x_shape, ctx.params = x.shape, params
        return op(w, x) if w_first else op(x, w)

    @staticmethod
    def backward(ctx, gy):
        op, w, w_first, shape = ctx.op, ctx.w, ctx.w_first, ctx.x_shape
        x = ctx.saved_tensors[0] if op is aten.mul.Tensor else None
        if x is not None and w.grad_fn is None:
            _whole(ctx.module, (w,))
        ctx.stash.append(DeferredW(_elementwise_w, op, gy, x, w, w_first, ctx.params))
        ctx.w = ctx.stash = ctx.module = ctx.params = None
        gx = None
        if ctx.needs_input_grad[0]:
            gx = (gy * w if x is not None else gy).sum_to_size(shape)
            if op is aten.sub.Tensor and w_first:
                gx = gx.neg()
        return (gx, None, None, None, None, None, *[None] * (len(ctx.needs_input_grad) - 6))


# -- the hooked path: no Function of our own ---------------------------------------------
#
# Where the activation operand needs a gradient, the op runs as itself on *detached* weight
# operands: autograd's own node then computes only the input gradient in B (the kernels
# check which outputs are needed: addmm skips grad_output^T x, native_layer_norm_backward
# runs with output_mask [1, 0, 0]), and a hook on the output hands W its gradient. B thus
# costs no Python per op but that hook; the forward no Function.apply. W's entry is queued
# in the forward and runs once its hook has fired. Only while no saved-tensor hooks are
# active: what W keeps (the input, a norm's statistics) is held here, not saved through
# autograd, so sequence-parallel shards, zero=3's parameter gathers and the memory counters
# (all saved-tensor hooks) take the Function path above, which saves through them.

class _Hooked(DeferredW):
    """A W queued in the forward; its output gradient arrives from B through the hook."""
    __slots__ = ("gy", "nr", "kept", "version")

    def __init__(self, fn, *args):
        super().__init__(fn, *args)
        self.gy = self.nr = self.kept = self.version = None

    def __call__(self, grads):      # pre-hook of the output's node: keep, change nothing
        self.gy = grads[self.nr]

    def run(self):
        gy, self.gy = self.gy, None
        if gy is None:              # the output reached no loss: no weight gradient, as fused
            return None
        if self.kept is not None and self.kept._version != self.version:
            # what autograd's saved-tensor check would say; W would read the new values
            raise RuntimeError("zero-bubble W: an activation a deferred op kept for its weight "
                               "gradient was modified in place after the forward")
        return self.fn(gy, *self.args)


def _hooked(stash: list, out: torch.Tensor, kept, fn, *args) -> torch.Tensor:
    # A pre-hook on the node that made `out` (half the cost of a tensor hook), taken now:
    # an in-place op on `out` later gives the tensor another node, the gradient W needs is
    # still this one's. `kept`: the activation W reads (None: none), version-checked in W.
    entry = _Hooked(fn, *args)
    entry.nr = out.output_nr
    if kept is not None:
        entry.kept, entry.version = kept, kept._version
    out.grad_fn.register_prehook(entry)
    stash.append(entry)
    return out


def _hooks_free() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _d(t):
    return None if t is None else t.detach()


# -- matching -----------------------------------------------------------------------------

def _params_are(operands, params) -> bool:
    """The weight operands (None: absent) are exactly the trainable parameters `params`."""
    # (plain loops: this runs once per op per forward)
    n = 0
    for o in operands:
        if o is not None:
            n += 1
            for p in params:
                if o is p:
                    break
            else:
                return False
    if n != len(params):
        return False
    for p in params:
        if not p.requires_grad:
            return False
    return True


def _act(x, *weights) -> bool:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return False
    dtype = x.dtype
    for w in weights:
        if w is not None and w.dtype != dtype:
            return False
    return True


_ELEMENTWISE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)

# The hooked path calls the same ATen ops through their torch.* bindings: an OpOverload's
# __call__ (aten.linear.default(...)) costs about 5 us more per call in Python (10 against
# 5 us for a 4 x 8 linear), as much as all the split's own bookkeeping in the forward.
# Plain tensors only reach this path (parameters detached, activations of the eager
# runtime), so the bindings' __torch_function__ check finds nothing to do.
_linear = torch._C._nn.linear
_FAST = {aten.add.Tensor: torch.add, aten.sub.Tensor: torch.sub, aten.mul.Tensor: torch.mul}


def written_out(op, args: tuple, kwargs: dict, params: tuple, stash: list, module, weights: tuple = ()):
    """The op run with a written-out B/W split, or None where no rule applies (module doc).
    `weights`: the positions of the weight operands in args."""
    if kwargs or torch.is_autocast_enabled():
        return None
    n = len(args)
    if op is aten.linear.default and n in (2, 3):
        x, w, b = args[0], args[1], args[2] if n == 3 else None
        if _params_are((w, b), params) and _act(x, w, b):
            if x.requires_grad and _hooks_free():
                return _hooked(stash, _linear(x, w.detach(), _d(b)), x, _linear_w, x, w, b)
            return _Linear.apply(x, w, b, stash, module)
    elif op is aten.addmm.default and n == 3:
        b, x, w = args
        if _params_are((w, b), params) and _act(x, w, b) and x.dim() == 2:
            if x.requires_grad and _hooks_free():
                return _hooked(stash, torch.addmm(b.detach(), x, w.detach()), x, _addmm_w, x, w, b)
            return _Addmm.apply(x, w, b, stash, module)
    elif op is aten.layer_norm.default and 3 <= n <= 6:
        x, shape = args[0], args[1]
        w, b = args[2], args[3] if n > 3 else None
        eps = args[4] if n > 4 else 1e-5
        if w is not None and _params_are((w, b), params) and _act(x, w, b):
            if x.requires_grad and _hooks_free():
                # gamma's and beta's gradients come out of the same kernel pass as x's for a
                # third more kernel time (31 us against 23 at 256 x 256); deferring them cost
                # more Python than that (B+W 1.47x the fused backward): they stay in B
                return torch.layer_norm(*args)
            return _LayerNorm.apply(x, w, b, list(shape), eps, stash, module)
    elif op is aten.embedding.default and 2 <= n <= 4:
        w, ids = args[0], args[1]
        padding_idx, scale = (args[2] if n > 2 else -1), (args[3] if n > 3 else False)
        if _params_are((w,), params) and w.is_floating_point() and not ids.is_floating_point():
            return _Embedding.apply(w, ids, padding_idx, scale, stash, module)
    elif op in _ELEMENTWISE and n == 2 and len(weights) == 1:
        i = weights[0]
        w, x = args[i], args[1 - i]
        if (isinstance(w, torch.Tensor) and _act(x, w) and x is not w
                and (_params_are((w,), params) or (w.grad_fn is not None and w.requires_grad))):
            if x.requires_grad and _hooks_free():
                fast = _FAST[op]
                out = fast(w.detach(), x) if i == 0 else fast(x, w.detach())
                x_w = x if op is aten.mul.Tensor else None    # W of a sum needs no input
                return _hooked(stash, out, x_w, _elementwise_w_hooked, op, x_w, w, i == 0, params)
            return _Elementwise.apply(x, op, (w,), i == 0, stash, module, *params)
    return None
