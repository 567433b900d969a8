"""Hand-written decoders whose attention or projections are written the awkward ways.

All share one skeleton (embedding + learned positions, pre-norm blocks, LayerNorm, head);
only the block's attention / MLP differ.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, LAYERS, VOCAB, SEQ, token_batch, workload

HEADS = 4


def causal_attention(q, k, v):
    """q, k, v: [B, nh, T, hd] -> [B, nh, T, hd], written out (no SDPA)."""
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return att @ v


class NanoGPTAttention(nn.Module):
    """nanoGPT: fused c_attn split three ways, and y.transpose(1, 2).contiguous().view(B, T, C)."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        y = causal_attention(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class FusedQKVIndexAttention(nn.Module):
    """A fused QKV projection sliced by indexing: qkv[..., :C], qkv[..., C:2*C], ..."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
        heads = lambda t: t.reshape(B, T, HEADS, C // HEADS).permute(0, 2, 1, 3)
        y = causal_attention(heads(q), heads(k), heads(v))
        return self.out(y.permute(0, 2, 1, 3).reshape(B, T, C))


class GQARepeatInterleaveAttention(nn.Module):
    """Grouped-query attention: 4 query heads, 2 kv heads, kv widened by repeat_interleave."""

    def __init__(self, kv_heads: int = 2):
        super().__init__()
        self.kv_heads, self.hd = kv_heads, HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(HIDDEN, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, HEADS, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        rep = HEADS // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class ParamMatmulAttention(nn.Module):
    """Every projection written as x @ W.T + b with W an nn.Parameter (no nn.Linear)."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.02) for _ in range(4))
        self.bo = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x):
        B, T, C = x.shape
        heads = lambda t: t.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        y = causal_attention(heads(x @ self.wq.T), heads(x @ self.wk.T), heads(x @ self.wv.T))
        return y.transpose(1, 2).reshape(B, T, C) @ self.wo.T + self.bo


class ParamMatmulMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4 * HIDDEN, HIDDEN) * 0.02)
        self.w2 = nn.Parameter(torch.randn(HIDDEN, 4 * HIDDEN) * 0.02)

    def forward(self, x):
        return F.gelu(x @ self.w1.T) @ self.w2.T


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class FlatMLP(nn.Module):
    """OPT's and GPT-2 Conv1D's layout: the MLP runs on tokens flattened to [B*T, C]."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        B, T, C = x.shape
        return self.proj(F.gelu(self.fc(x.reshape(-1, C)))).view(B, T, C)


class ManualRMSNorm(nn.Module):
    """RMSNorm written out (pow, mean, rsqrt, mul) as LLaMA and OLMo2 write it."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class FullWidthQKNormAttention(nn.Module):
    """OLMo2's layout: RMSNorm over the whole q (and k) projection width, before the heads
    are split, so the norm reduces over the dimension tensor parallelism shards."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.q_norm, self.k_norm = ManualRMSNorm(HIDDEN), ManualRMSNorm(HIDDEN)
        with torch.no_grad():   # uneven norm weights: the norm's gradient is not negligible
            self.q_norm.weight.uniform_(0.5, 3.0)
            self.k_norm.weight.uniform_(0.5, 3.0)

    def forward(self, x):
        B, T, C = x.shape
        heads = lambda t: t.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q, k = self.q_norm(self.q(x)), self.k_norm(self.k(x))
        y = causal_attention(heads(q), heads(k), heads(self.v(x)))
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class SoftmaxRouterMoE(nn.Module):
    """4 experts, softmax router, top-2 gates scattered back, experts computed densely."""

    def __init__(self, experts: int = 4, k: int = 2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleList(MLP() for _ in range(experts))

    def forward(self, x):
        probs = self.router(x).softmax(dim=-1)                    # [B, T, E]
        top_p, top_i = probs.topk(self.k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, top_i, top_p / top_p.sum(-1, keepdim=True))
        return sum(gates[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, attn: type, mlp: type = MLP):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn, self.mlp = attn(), mlp()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyDecoder(nn.Module):
    def __init__(self, attn: type, mlp: type = MLP, layers: int = LAYERS):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block(attn, mlp) for _ in range(layers))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx):                              # [B, T]
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))                # [B, T, V]


def decoder_with(attn: type, mlp: type = MLP):
    def factory(seed: int = 0):
        torch.manual_seed(seed)
        inputs, target = token_batch(seed=seed)
        return workload(TinyDecoder(attn, mlp).train(), (inputs,), target)
    factory.__name__ = f"decoder_with_{attn.__name__}_{mlp.__name__}"
    return factory


FACTORIES = {
    "hw_nanogpt": decoder_with(NanoGPTAttention),
    "hw_fused_qkv_index": decoder_with(FusedQKVIndexAttention),
    "hw_gqa_repeat_interleave": decoder_with(GQARepeatInterleaveAttention),
    "hw_param_matmul": decoder_with(ParamMatmulAttention, ParamMatmulMLP),
    "hw_moe_softmax": decoder_with(NanoGPTAttention, SoftmaxRouterMoE),
    "hw_flat_mlp": decoder_with(NanoGPTAttention, FlatMLP),
    "hw_qk_norm_full_width": decoder_with(FullWidthQKNormAttention),
}
