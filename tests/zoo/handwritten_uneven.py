"""Hand-written decoders whose heads or feed-forward width tp=2 does not divide (issue 21
item 5): 3 attention heads, and an MLP 37 wide. Under tp=2 both are padded (a zero head,
a zero feature) instead of kept whole; parity must still be exact.

  hw_three_heads   3 heads of 8 (q/k/v 32 -> 24, out 24 -> 32), GELU MLP
  hw_odd_ffn       4 heads, MLP 32 -> 37 -> 32 through a sigmoid, which is 0.5 on a padded
                   feature (so the padding's gradient must be masked to stay exact)
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.zoo.common import HIDDEN
from tests.zoo.handwritten_attention import NanoGPTAttention, causal_attention, decoder_with


class ThreeHeadAttention(nn.Module):
    def __init__(self, heads: int = 3, head_dim: int = 8):
        super().__init__()
        self.heads, self.hd = heads, head_dim
        self.q = nn.Linear(HIDDEN, heads * head_dim)
        self.k = nn.Linear(HIDDEN, heads * head_dim)
        self.v = nn.Linear(HIDDEN, heads * head_dim)
        self.o = nn.Linear(heads * head_dim, HIDDEN)

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.heads, self.hd).transpose(1, 2)      # [B, 3, T, 8]
        y = causal_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(y.transpose(1, 2).reshape(B, T, self.heads * self.hd))


class OddSigmoidMLP(nn.Module):
    def __init__(self, width: int = 37):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, width)
        self.proj = nn.Linear(width, HIDDEN)

    def forward(self, x):
        return self.proj(torch.sigmoid(self.fc(x)))


FACTORIES = {
    "hw_three_heads": decoder_with(ThreeHeadAttention),
    "hw_odd_ffn": decoder_with(NanoGPTAttention, OddSigmoidMLP),
}
