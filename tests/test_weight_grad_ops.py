"""Written-out B/W split per op (runtime/weight_grad_ops.py): B gives exactly the fused
input gradient and no weight gradient, W the fused weight gradients, and no autograd graph
is kept for W (issue 25 item 3)."""
import contextlib

import pytest
import torch

from threefold.runtime.weight_grad import deferred, run_deferred
from threefold.runtime.weight_grad_ops import DeferredW, _Hooked

aten = torch.ops.aten


class _Holder:
    weight_stash = None


def _param(*shape):
    return torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64))


def _act(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def _cases():
    x3 = _act(2, 3, 6)
    w, b = _param(5, 6), _param(5)
    yield "linear", aten.linear.default, (x3, w, b), (1, 2), (w, b)
    w = _param(5, 6)
    yield "linear no bias", aten.linear.default, (_act(4, 6), w), (1,), (w,)
    w, b = _param(6, 5), _param(5)
    yield "addmm", aten.addmm.default, (b, _act(4, 6), w), (0, 2), (b, w)
    g, b = _param(6), _param(6)
    yield "layer_norm", aten.layer_norm.default, (_act(2, 3, 6), [6], g, b, 1e-5), (2, 3), (g, b)
    g = _param(6)
    yield "layer_norm no bias", aten.layer_norm.default, (_act(4, 6), [6], g), (2,), (g,)
    e = _param(10, 6)
    ids = torch.tensor([[1, 2, 2], [9, 0, 1]])
    yield "embedding", aten.embedding.default, (e, ids), (0,), (e,)
    e = _param(10, 6)
    yield "embedding padding_idx", aten.embedding.default, (e, ids, 2), (0,), (e,)
    g = _param(6)
    yield "mul weight first", aten.mul.Tensor, (g, _act(2, 3, 6)), (0,), (g,)
    g = _param(3, 1)
    yield "mul broadcast", aten.mul.Tensor, (_act(2, 3, 6), g), (1,), (g,)


def _hooks_if(on: bool):
    # active saved-tensor hooks (sp shards, zero=3, memory counters) take the Function path
    if on:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    return contextlib.nullcontext()


def _norm_in_b(op, acts, hooks) -> bool:
    """On the hooked path a layer norm's weight gradients stay in B (the fused kernel)."""
    return op is aten.layer_norm.default and bool(acts) and not hooks


@pytest.mark.parametrize("hooks", [False, True], ids=["hooked path", "under saved-tensor hooks"])
@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_written_out_split_equals_the_fused_backward(case, hooks):
    name, op, args, weights, params = case
    acts = [a for i, a in enumerate(args) if i not in weights and isinstance(a, torch.Tensor)
            and a.requires_grad]
    for t in (*acts, *params):
        t.grad = None
    out = op(*args)
    seed = torch.randn_like(out)
    expected = torch.autograd.grad(out, [*acts, *params], seed)
    holder = _Holder()
    holder.weight_stash = []
    with _hooks_if(hooks):
        y = deferred(holder, op, args, weights=weights, params=params)
    assert torch.equal(y, out)
    y.backward(seed)                                             # B
    for a, e in zip(acts, expected):
        torch.testing.assert_close(a.grad, e, rtol=1e-12, atol=1e-12)
    if _norm_in_b(op, acts, hooks):
        assert not holder.weight_stash and all(p.grad is not None for p in params), name
    else:
        assert all(p.grad is None for p in params), name          # B leaves the weights alone
        assert len(holder.weight_stash) == 1 and isinstance(holder.weight_stash[0], DeferredW), name
    run_deferred(holder.weight_stash)                             # W
    for p, e in zip(params, expected[len(acts):]):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)


def test_a_weight_computed_from_parameters_takes_the_generic_path():
    w = _param(5, 6)
    x = _act(4, 6)
    holder = _Holder()
    holder.weight_stash = []
    y = deferred(holder, aten.mm.default, (x, w.t()), weights=(1,), params=(w,))
    y.sum().backward()
    assert not isinstance(holder.weight_stash[0], DeferredW)
    run_deferred(holder.weight_stash)
    torch.testing.assert_close(w.grad, torch.ones(4, 5, dtype=torch.float64).t().mm(x.detach()))


def _fused_and_split(op, args, weights, params, seeds, hooks=False):
    """Per seed (a microbatch): fused autograd grads vs B then W, accumulated over the seeds."""
    acts = [a for i, a in enumerate(args) if i not in weights and isinstance(a, torch.Tensor)
            and a.requires_grad]
    for t in (*acts, *params):       # the case tuples are shared by the parametrizations
        t.grad = None
    expected = None
    for seed in seeds:
        g = torch.autograd.grad(op(*args), [*acts, *params], seed, retain_graph=True)
        expected = g if expected is None else [e + x for e, x in zip(expected, g)]
    holder = _Holder()
    for seed in seeds:
        holder.weight_stash = []
        with _hooks_if(hooks):
            y = deferred(holder, op, args, weights=weights, params=params)
        # the hooked path (no Function of ours) wherever an activation needs a gradient
        hooked = bool(holder.weight_stash) and isinstance(holder.weight_stash[0], _Hooked)
        assert hooked == (bool(acts) and not hooks and not _norm_in_b(op, acts, hooks))
        y.backward(seed)                                          # B
        run_deferred(holder.weight_stash)                         # W
    return acts, params, expected


@pytest.mark.parametrize("hooks", [False, True], ids=["hooked path", "under saved-tensor hooks"])
@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_two_microbatches_accumulate_like_autograd(case, hooks):
    """W adds into an existing .grad in place (addmm_, index_add_); B+W twice equals two fused
    backwards, in float64, whichever path the op takes; W leaves no graph behind."""
    name, op, args, weights, params = case
    out = op(*args)
    seeds = [torch.randn_like(out), torch.randn_like(out)]
    acts, params, expected = _fused_and_split(op, args, weights, params, seeds, hooks)
    for a, e in zip(acts, expected):
        torch.testing.assert_close(a.grad, e, rtol=1e-12, atol=1e-12)
    for p, e in zip(params, expected[len(acts):]):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)
        assert not p.grad.requires_grad and p.grad.grad_fn is None, name


def _computed_cases():
    x = _act(2, 3, 6)
    e = _param(5, 6)
    pos = torch.tensor([0, 3, 4])
    wpe = aten.embedding.default(e, pos)                    # a position embedding's rows
    yield "add embedding rows", aten.add.Tensor, (x, wpe), (1,), (e,)
    e = _param(5, 6)
    rows = aten.embedding.default(e, pos)
    yield "sub embedding rows, weight first", aten.sub.Tensor, (rows, _act(2, 3, 6)), (0,), (e,)
    g = _param(6)
    yield "mul by 1 + w", aten.mul.Tensor, (_act(2, 3, 6), aten.add.Tensor(g, 1.0)), (1,), (g,)
    g = _param(6)
    yield "sub a parameter", aten.sub.Tensor, (_act(4, 6), g), (1,), (g,)
    b = _param(4, 6)
    yield "add a same-shaped parameter", aten.add.Tensor, (_act(4, 6), b), (1,), (b,)


@pytest.mark.parametrize("case", list(_computed_cases()), ids=lambda c: c[0])
def test_elementwise_with_a_weight_computed_from_parameters(case):
    """add/sub/mul whose weight operand is a parameter or a value made from parameters only:
    written out (was the generic double-autograd path), W walks the value's graph once."""
    name, op, args, weights, params = case
    out = op(*args)
    # an embedding's graph is built once here (each forward builds its own): one microbatch
    seeds = [torch.randn_like(out) for _ in range(1 if "embedding" in name else 2)]
    acts, params, expected = _fused_and_split(op, args, weights, params, seeds)
    for t, e in zip([*acts, *params], expected):
        torch.testing.assert_close(t.grad, e, rtol=1e-12, atol=1e-12)


def test_an_in_place_op_on_the_output_after_the_forward():
    """W needs the gradient of the op's own output, not of what an in-place op made of it."""
    x, w, b = _act(4, 6), _param(5, 6), _param(5)
    ref = torch.nn.functional.linear(x, w, b)
    ref = ref.mul(3.0)
    expected = torch.autograd.grad(ref.sum(), (x, w, b))
    holder = _Holder()
    holder.weight_stash = []
    y = deferred(holder, aten.linear.default, (x, w, b), weights=(1, 2), params=(w, b))
    y.mul_(3.0)
    y.sum().backward()
    run_deferred(holder.weight_stash)
    for t, e in zip((x, w, b), expected):
        torch.testing.assert_close(t.grad, e, rtol=1e-12, atol=1e-12)


def test_an_output_that_reaches_no_loss_leaves_no_gradient():
    x, w = _act(4, 6), _param(5, 6)
    holder = _Holder()
    holder.weight_stash = []
    deferred(holder, aten.linear.default, (x, w), weights=(1,), params=(w,))
    (x * 2).sum().backward()
    run_deferred(holder.weight_stash)
    assert w.grad is None and not holder.weight_stash


def test_an_input_changed_in_place_after_the_forward_is_an_error_not_a_wrong_gradient():
    """autograd refuses a saved tensor modified in place; W (which keeps the input itself on
    the hooked path) must refuse too, not compute the weight gradient from the new values."""
    x, w = _act(4, 6), _param(5, 6)
    a = x * 1.0
    holder = _Holder()
    holder.weight_stash = []
    y = deferred(holder, aten.linear.default, (a, w), weights=(1,), params=(w,))
    y.sum().backward()
    with torch.no_grad():
        a.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        run_deferred(holder.weight_stash)


# -- the straight-line entry points the generated code calls (weight_grad.linear, layer_norm)

def _entry_cases():
    from threefold.runtime import weight_grad
    w, b = _param(5, 6), _param(5)
    yield "linear", weight_grad.linear, aten.linear.default, lambda x, w=w, b=b: (x, w, b), (w, b)
    w = _param(5, 6)
    yield "linear no bias", weight_grad.linear, aten.linear.default, lambda x, w=w: (x, w), (w,)
    g, b = _param(6), _param(6)
    yield ("layer_norm", weight_grad.layer_norm, aten.layer_norm.default,
           lambda x, g=g, b=b: (x, [6], g, b, 1e-5, False), (g, b))
    g = _param(6)
    yield ("layer_norm no bias", weight_grad.layer_norm, aten.layer_norm.default,
           lambda x, g=g: (x, [6], g), (g,))


@pytest.mark.parametrize("x_grad", [True, False], ids=["activation needs a gradient", "it does not"])
@pytest.mark.parametrize("hooks", [False, True], ids=["hooked path", "under saved-tensor hooks"])
@pytest.mark.parametrize("case", list(_entry_cases()), ids=lambda c: c[0])
def test_straight_line_entry_points_equal_autograd(case, hooks, x_grad):
    """weight_grad.linear / layer_norm (what codegen writes in place of `deferred` where the
    weights are parameters themselves): two microbatches of B then W equal two fused
    backwards in float64, on whichever path their conditions pick."""
    name, entry, op, make_args, params = case
    for p in params:
        p.grad = None
    xs = [torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=x_grad) for _ in range(2)]
    seeds = [torch.randn(2, 3, params[0].shape[0] if "linear" in name else 6, dtype=torch.float64)
             for _ in range(2)]
    expected_x, expected_p = [], [torch.zeros_like(p) for p in params]
    for x, seed in zip(xs, seeds):
        got = torch.autograd.grad(op(*make_args(x)), [*([x] if x_grad else []), *params], seed)
        expected_x += got[:1] if x_grad else []
        expected_p = [e + g for e, g in zip(expected_p, got[1 if x_grad else 0:])]
    holder = _Holder()
    for x, seed in zip(xs, seeds):
        holder.weight_stash = []
        with _hooks_if(hooks):
            y = entry(holder, *make_args(x))
        torch.testing.assert_close(y, op(*make_args(x)).detach(), rtol=0, atol=0)
        y.backward(seed)                                          # B
        if x_grad and not hooks:     # the hooked path, inline: no Function of ours
            assert (isinstance(holder.weight_stash[0], _Hooked) if "linear" in name
                    else not holder.weight_stash), name
        else:                        # the rules of `deferred`: one Function per op
            assert len(holder.weight_stash) == 1 and not isinstance(holder.weight_stash[0], _Hooked)
        run_deferred(holder.weight_stash)                         # W
    for t, e in zip([*(xs if x_grad else []), *params], [*expected_x, *expected_p]):
        torch.testing.assert_close(t.grad, e, rtol=1e-12, atol=1e-12)


def test_straight_line_entry_points_without_a_stash_or_grad_are_the_op():
    from threefold.runtime import weight_grad
    w, b, x = _param(5, 6), _param(5), _act(2, 3, 6)
    holder = _Holder()                                            # weight_stash None: fused
    y = weight_grad.linear(holder, x, w, b)
    y.sum().backward()
    assert w.grad is not None and b.grad is not None and x.grad is not None
    holder.weight_stash = []
    with torch.no_grad():
        y = weight_grad.linear(holder, x, w, b)
        z = weight_grad.layer_norm(holder, x, [6], _param(6), None, 1e-5, False)
    assert not y.requires_grad and not z.requires_grad and not holder.weight_stash


def test_straight_line_linear_with_a_frozen_weight_leaves_it_alone():
    """A parameter frozen after the code was generated: no weight gradient anywhere, the
    bias's still deferred to W (the generic rules decide, as `deferred` would)."""
    from threefold.runtime import weight_grad
    w, b, x = _param(5, 6), _param(5), _act(4, 6)
    w.requires_grad_(False)
    holder = _Holder()
    holder.weight_stash = []
    y = weight_grad.linear(holder, x, w, b)
    y.sum().backward()
    assert b.grad is None and x.grad is not None
    run_deferred(holder.weight_stash)
    torch.testing.assert_close(b.grad, torch.full((5,), 4.0, dtype=torch.float64))
    assert w.grad is None
