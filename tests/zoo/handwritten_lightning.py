"""Hand-written decayed linear attention: MiniMax's lightning attention and RetNet's retention.

Each replaces the decoder's attention (tests/zoo/handwritten_attention.py's skeleton) with a
causal mixer without softmax whose scores decay with the distance j - i:
- lightning attention walks the sequence in blocks of `block` positions, reading decay tables
  precomputed as buffers and sliced to the block's length (the whole sequence is one block
  when it is shorter than `block`: the tables are then sliced to the sequence, on two dims at
  once), the state K^T V handed from block to block;
- retention builds its decay mask in forward from arange over the sequence.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, token_batch, workload
from tests.zoo.handwritten_attention import HEADS, TinyDecoder, decoder_with


def _slopes(heads: int) -> torch.Tensor:
    return (1 / 2 ** (8 / heads)) ** (torch.arange(heads) + 1.0)   # ALiBi's geometric slopes


class LightningAttention(nn.Module):
    """Intra-block (Q K^T * decay[i - j]) V plus inter-block (Q * q_decay) S, the state
    S <- S * exp(-slope * b) + (K * k_decay)^T V, over blocks of `block` positions."""

    block = 16

    def __init__(self):
        super().__init__()
        b, d = self.block, HIDDEN // HEADS
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        slope = _slopes(HEADS)[:, None, None]                         # [H, 1, 1]
        pos = torch.arange(b) + 1.0
        diff = pos[:, None] - pos[None, :]                            # i - j
        self.register_buffer("slope", slope)
        self.register_buffer("q_decay", torch.exp(-slope * pos[:, None]))          # [H, b, 1]
        self.register_buffer("k_decay", torch.exp(-slope * (b - pos[:, None])))    # [H, b, 1]
        self.register_buffer("diag_decay", torch.exp(torch.where(diff >= 0, -slope * diff, float("-inf")))[None])
        self.head_dim = d

    def forward(self, x):                                             # [B, T, C]
        B, T, C = x.shape
        qkv = F.silu(self.qkv(x)).view(B, T, HEADS, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, self.head_dim, dim=3))   # [B, H, T, d]
        state = torch.zeros(B, HEADS, self.head_dim, self.head_dim, dtype=x.dtype)
        outs = []
        for i in range((T + self.block - 1) // self.block):
            lo, hi = i * self.block, min((i + 1) * self.block, T)
            b = hi - lo
            qb, kb, vb = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi]
            intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * self.diag_decay[:, :, :b, :b], vb)
            inter = torch.matmul(qb * self.q_decay[:, :b], state)
            outs.append(intra + inter)
            state = state * torch.exp(-self.slope * b) + torch.matmul((kb * self.k_decay[:, -b:]).transpose(-1, -2), vb)
        y = torch.cat(outs, dim=-2).transpose(1, 2).reshape(B, T, C)
        return self.out(y)


class LightningBlocks2(LightningAttention):
    """The same with blocks of 2 positions: a sequence of 8 is four blocks, the state carried."""
    block = 2


class Retention(nn.Module):
    """RetNet's parallel retention without softmax: (Q K^T * D) V with D[i, j] = gamma^(i - j)
    for j <= i, else 0, built in forward from arange(T)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.register_buffer("log_gamma", torch.log(1 - 2.0 ** (-5.0 - torch.arange(HEADS))))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        pos = torch.arange(T, device=x.device)
        diff = (pos[:, None] - pos[None, :]).to(x.dtype)                       # [T, T], i - j
        decay = torch.exp(self.log_gamma[:, None, None] * diff).masked_fill(diff < 0, 0.0)   # [H, T, T]
        y = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * decay / (C // HEADS) ** 0.5, v)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


def _longer_decoder(attn: type, positions: int = 32):
    """decoder_with(attn) with a position table of `positions` rows: the blocks case is run on
    sequences of 16 and 32 tokens (several blocks on each cp rank)."""
    def factory(seed: int = 0):
        torch.manual_seed(seed)
        model = TinyDecoder(attn)
        model.wpe = nn.Embedding(positions, HIDDEN)
        inputs, target = token_batch(seed=seed)
        return workload(model.train(), (inputs,), target)
    factory.__name__ = f"longer_decoder_{attn.__name__}"
    return factory


FACTORIES = {
    "hw_lightning": decoder_with(LightningAttention),
    "hw_lightning_blocks": _longer_decoder(LightningBlocks2),
    "hw_retention": decoder_with(Retention),
}
