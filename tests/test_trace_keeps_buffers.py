"""Tracing must leave the user's module as it was: a model that caches a tensor with
register_buffer in forward (PaLM-pytorch's causal mask) kept the fake tensor export computed,
so the module broke afterwards (parallelize failed on '.numpy() is not supported for tensor
subclasses' while agreeing weights across ranks), and the batch-dim probe's restore failed on
the buffer it had not seen (KeyError)."""
import pytest
import torch

from threefold.compiler.api import compile_workload
from tests.zoo.common import lm_loss, token_batch, workload


class CachedMaskLM(torch.nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("mask", None, persistent=False)   # filled on first use
        self.register_buffer("scale", torch.ones(dim))

    def causal_mask(self, n):
        if self.mask is not None and self.mask.shape[-1] >= n:
            return self.mask[:n, :n]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        return mask

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        scores = (h @ h.transpose(1, 2)).masked_fill(self.causal_mask(ids.shape[1]), float("-inf"))
        return self.head(scores.softmax(-1) @ h)


# tp=2: torch.export's trace; pp=2,m=2: also the eager batch-dim probe (passes/batch_dims.py)
@pytest.mark.parametrize("plan", ["tp=2", "pp=2,m=2"])
def test_compile_leaves_buffers_registered_in_forward_untouched(plan):
    torch.manual_seed(0)
    model = CachedMaskLM()
    inputs, target = token_batch(vocab=32, batch=2, seq=6)
    before = dict(model.named_buffers())
    compile_workload(workload(model, (inputs,), target, lm_loss), plan)
    after = dict(model.named_buffers())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), after.keys()
    assert model.mask is None
    assert torch.isfinite(lm_loss(model(inputs), target))   # eager use still works, with real tensors
    assert type(model.mask) is torch.Tensor
