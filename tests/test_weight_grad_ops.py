"""Written-out B/W split per op (runtime/weight_grad_ops.py): B gives exactly the fused
input gradient and no weight gradient, W the fused weight gradients, and no autograd graph
is kept for W (issue 25 item 3)."""
import pytest
import torch

from threefold.runtime.weight_grad import deferred, run_deferred
from threefold.runtime.weight_grad_ops import DeferredW

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


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_written_out_split_equals_the_fused_backward(case):
    name, op, args, weights, params = case
    acts = [a for i, a in enumerate(args) if i not in weights and isinstance(a, torch.Tensor)
            and a.requires_grad]
    out = op(*args)
    seed = torch.randn_like(out)
    expected = torch.autograd.grad(out, [*acts, *params], seed)
    holder = _Holder()
    holder.weight_stash = []
    y = deferred(holder, op, args, weights=weights, params=params)
    assert torch.equal(y, out)
    y.backward(seed)                                             # B
    for a, e in zip(acts, expected):
        torch.testing.assert_close(a.grad, e, rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for p in params), name              # B leaves the weights alone
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
