"""The batch dimension is told by the outputs that have rows: a model returning its own
loss beside its logits (the HF `labels=` style) is not ambiguous because the scalar loss
is no slice of anything, also when the batch equals the sequence length (issue 40 item 5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from threefold.passes.batch_dims import find_batch_dims

V, H = 11, 8


class CausalWithLoss(nn.Module):
    """A causal mixer over the sequence (a cumulative mean), then logits and their loss."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, H), nn.Linear(H, V)

    def forward(self, ids, labels):
        h = self.emb(ids)                                             # [B, T, H]
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)
        h = h.cumsum(1) / steps[None, :, None]                        # position t sees 0..t
        logits = self.head(h)
        return logits, F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


@pytest.mark.parametrize("batch,seq", [(4, 6), (6, 6)])
def test_a_models_own_scalar_loss_does_not_hide_the_batch_dim(batch, seq):
    torch.manual_seed(0)
    ids, labels = torch.randint(0, V, (batch, seq)), torch.randint(0, V, (batch, seq))
    dims = find_batch_dims(CausalWithLoss(), (ids, labels), 2, parts=2, name="CausalWithLoss")
    assert dims == [0, 0]
