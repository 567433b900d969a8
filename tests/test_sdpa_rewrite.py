"""runtime/sdpa_rewrite.py: materialised attention in a Dynamo graph -> one SDPA call.

Each case captures a function with Dynamo, rewrites the graph and runs it eagerly (no
Inductor compile: fast), and compares the output and the input gradients with the function
run eagerly: the rewrite must keep eager's numbers, fully masked rows' NaN included, and
leave alone what SDPA cannot reproduce.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from threefold.runtime import sdpa_rewrite

aten = torch.ops.aten
B, H, T, D = 2, 3, 8, 4


def _captured(fn, *args, grad_args=3):
    """(outputs, input grads, number rewritten) of fn's Dynamo graph after the rewrite."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(sdpa_rewrite.rewrite(gm, min_keys=1))
        assert all(n.target is not aten.softmax.int for n in gm.graph.nodes) or not counts[-1]
        return gm.forward
    torch._dynamo.reset()
    try:
        return _run(torch.compile(fn, backend=backend, fullgraph=True), *args, grad_args=grad_args) + (sum(counts),)
    finally:
        torch._dynamo.reset()


def _run(fn, *args, grad_args=3):
    """fn's outputs and the gradients of its first grad_args inputs (q, k, v; a mask needs none)."""
    args = [a.detach().clone().requires_grad_(i < grad_args) for i, a in enumerate(args)]
    out = fn(*args)
    first = out[0] if isinstance(out, tuple) else out
    first.backward(torch.ones_like(first))
    return out, [a.grad for a in args if a.grad is not None]


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(3)]


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def nanogpt(q, k, v, keep):   # the chain threefold's GPT chunks carry (dropout p=0 in train mode)
    att = aten.mul.Tensor(aten.matmul.default(q, aten.transpose.int(k, -2, -1)), 1.0 / math.sqrt(D))
    att = aten.masked_fill.Scalar(att, aten.bitwise_not.default(keep), -math.inf)
    att = aten.dropout.default(aten.softmax.int(att, -1), 0.0, True)
    return aten.matmul.default(att, v)


def hf_eager(q, k, v, additive):   # Hugging Face's eager attention: additive mask, softmax dtype
    att = aten.mul.Tensor(aten.matmul.default(q, aten.transpose.int(k, 2, 3)), 0.5)
    att = aten.add.Tensor(att, additive)
    p = aten.to.dtype(aten.softmax.int(att, -1, torch.float32), torch.float32)
    return aten.matmul.default(aten.dropout.default(p, 0.0, True), v)


def causal(t=T):
    return torch.tril(torch.ones(t, t, dtype=torch.bool)).view(1, 1, t, t)


@pytest.mark.parametrize("fn, mask", [
    (nanogpt, causal()),
    (hf_eager, torch.zeros(B, 1, T, T).masked_fill(~causal(), torch.finfo(torch.float32).min)),
    (hf_eager, torch.zeros(B, 1, T, T).masked_fill(~causal(), -math.inf)),
], ids=["masked_fill-bool", "additive-finfo-min", "additive-inf"])
def test_attention_chains_become_sdpa_with_eagers_numbers(fn, mask):
    q, k, v = _qkv()
    (out, grads, n) = _captured(fn, q, k, v, mask)
    ref, ref_grads = _run(fn, q, k, v, mask)
    assert n == 1
    assert _close(out, ref)
    assert len(grads) == 3 and all(_close(g, r) for g, r in zip(grads, ref_grads))


def test_a_fully_masked_row_stays_nan_as_in_eager():
    keep = causal().clone()
    keep[..., 2, :] = False             # query 2 may attend to nothing: eager's softmax is NaN
    q, k, v = _qkv(1)
    out, _, n = _captured(nanogpt, q, k, v, keep)
    ref, _ = _run(nanogpt, q, k, v, keep)
    assert n == 1
    assert torch.isnan(ref[:, :, 2]).all() and torch.isnan(out[:, :, 2]).all()
    assert _close(out, ref)


def with_dropout(q, k, v, keep):
    att = aten.masked_fill.Scalar(aten.matmul.default(q, aten.transpose.int(k, -2, -1)),
                                  aten.bitwise_not.default(keep), -math.inf)
    return aten.matmul.default(aten.dropout.default(aten.softmax.int(att, -1), 0.1, True), v)


def probabilities_returned(q, k, v, keep):
    p = aten.softmax.int(aten.matmul.default(q, aten.transpose.int(k, -2, -1)), -1)
    return aten.matmul.default(p, v), p


def finite_fill(q, k, v, keep):
    att = aten.masked_fill.Scalar(aten.matmul.default(q, aten.transpose.int(k, -2, -1)),
                                  aten.bitwise_not.default(keep), -1e9)
    return aten.matmul.default(aten.softmax.int(att, -1), v)


def softmax_upcast(q, k, v, keep):   # bf16 models upcast the softmax: not eager's arithmetic in SDPA
    att = aten.matmul.default(q, aten.transpose.int(k, -2, -1)).to(torch.bfloat16)
    return aten.matmul.default(aten.softmax.int(att, -1, torch.float32), v)


@pytest.mark.parametrize("fn", [with_dropout, probabilities_returned, finite_fill, softmax_upcast])
def test_chains_sdpa_cannot_reproduce_are_left_as_written(fn):
    q, k, v = _qkv(2)
    torch.manual_seed(0)
    out, grads, n = _captured(fn, q, k, v, causal())
    assert n == 0


def test_a_learned_additive_bias_is_left_as_written():
    """The flash kernel gives attn_mask no gradient: a bias that needs one stays eager's."""
    q, k, v = _qkv(3)
    bias = torch.randn(1, H, T, T)
    out, grads, n = _captured(hf_eager, q, k, v, bias, grad_args=4)
    ref, ref_grads = _run(hf_eager, q, k, v, bias, grad_args=4)
    assert n == 0 and len(grads) == 4 and all(_close(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.timeout(600)   # one process; one Inductor compile of a tiny chunk (5 s cached, ~20 s cold)
def test_compiled_gpt_chunks_use_sdpa_and_match_one_process(monkeypatch):
    """End to end: under compile=inductor the generated chunk's attention (threefold's GPT,
    one chain per layer) reaches Inductor rewritten, and SGD losses equal one process's."""
    import threefold
    from tests.parity import load_workload, max_rel_diff, parallel_sgd_losses, reference_losses
    counts = []
    real = sdpa_rewrite.rewrite
    monkeypatch.setattr(sdpa_rewrite, "MIN_KEYS", 1)   # the tiny model's 8 keys
    monkeypatch.setattr(sdpa_rewrite, "rewrite", lambda gm: counts.append(real(gm)) or counts[-1])
    torch._dynamo.reset()
    kwargs = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 8, "batch": 8}
    ref = reference_losses("gpt", kwargs, 3)
    w = load_workload("gpt", **kwargs)
    pm = threefold.parallelize(w["model"], "compile=inductor", w["inputs"], w["loss_fn"], target=w["target"])
    try:
        got = parallel_sgd_losses(pm, w, 3)
    finally:
        torch._dynamo.reset()
    assert sum(counts) == kwargs["n_layer"]
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)


def scaled_mask(q, k, v, additive):   # add(s, A, alpha=2) adds 2A: not SDPA's mask
    att = aten.add.Tensor(aten.matmul.default(q, aten.transpose.int(k, -2, -1)), additive, alpha=2)
    return aten.matmul.default(aten.softmax.int(att, -1), v)


def test_an_additive_mask_with_alpha_is_left_as_written():
    q, k, v = _qkv(4)
    mask = torch.randn(1, 1, T, T)
    out, grads, n = _captured(scaled_mask, q, k, v, mask)
    ref, _ = _run(scaled_mask, q, k, v, mask)
    assert n == 0 and _close(out, ref)


def test_short_sequences_stay_as_written():
    """Below MIN_KEYS keys the flash kernels cost what they replace: no rewrite; from
    MIN_KEYS on, the default rewrites."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(sdpa_rewrite.rewrite(gm))
        return gm.forward
    for t in (T, sdpa_rewrite.MIN_KEYS):
        q, k, v = (torch.randn(1, 1, t, D) for _ in range(3))
        torch._dynamo.reset()
        try:
            torch.compile(nanogpt, backend=backend, fullgraph=True)(q, k, v, causal(t))
        finally:
            torch._dynamo.reset()
    assert T < sdpa_rewrite.MIN_KEYS and counts == [0, 1]
