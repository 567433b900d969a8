"""Models built from torch.nn's own transformer modules."""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.zoo.common import HIDDEN, LAYERS, VOCAB, SEQ, token_batch, workload


class SeqFirstEncoder(nn.Module):
    """nn.TransformerEncoder with batch_first=False: tokens are [seq, batch], so the batch
    dimension of the input is dim 1."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 4, 64, dropout=0.0, batch_first=False)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):                # [T, B]
        return self.head(self.encoder(self.emb(tokens)))   # [T, B, V]


def transformer_encoder_seq_first(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(SeqFirstEncoder().train(), (inputs.t().contiguous(),), target.t().contiguous())


class MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, 4, dropout=0.0, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 64), nn.GELU(), nn.Linear(64, HIDDEN))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHALM(nn.Module):
    """nn.MultiheadAttention (packed in_proj_weight, out_proj) with a causal float mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.blocks = nn.ModuleList(MHABlock() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), diagonal=1)
        x = self.emb(tokens) + self.pos[:T]
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def multihead_attention(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(MHALM().train(), (inputs,), target)


class DecoderLM(nn.Module):
    """nn.TransformerDecoder: self attention with a causal mask plus cross attention on a
    memory computed from the same tokens. tgt_is_causal=True: otherwise the decoder compares
    the mask with a causal one and branches on the result, which export cannot trace."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerDecoderLayer(HIDDEN, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, LAYERS)
        self.mem = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        T = tokens.shape[1]
        causal = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), diagonal=1)
        return self.head(self.decoder(x, self.mem(x), tgt_mask=causal, tgt_is_causal=True))


def transformer_decoder(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(DecoderLM().train(), (inputs,), target)


FACTORIES = {
    "nn_encoder_seq_first": transformer_encoder_seq_first,
    "nn_multihead_attention": multihead_attention,
    "nn_decoder": transformer_decoder,
}
