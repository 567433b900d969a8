"""Small attention models with the masks ring attention recomputes per step (cp masks):
padding from an input, ALiBi biases, sliding windows; and position-mixing ops that take the
all-gather fallback. Importable by spawned ranks (tests/cp_jobs.py)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import tests.zoo.handwritten_moe  # noqa: F401  (registers torch.ops.zoo_moe.gmm, a grouped matmul)


class MaskedAttention(nn.Module):
    """Embedding -> one attention layer (2 heads) with mask `mode` -> head.

    pad_sdpa:  SDPA, attn_mask = causal & key padding from attention_mask [B, S]
    pad_hand:  hand-written: masked_fill(causal) + (1 - attention_mask) * -1e9
    alibi:     hand-written: scores + slope_h * (j - i), masked_fill(causal)
    window:    hand-written causal sliding window of `window` positions
    pad_query: SDPA, causal & a padding mask over queries (padded queries see key 0 only):
               not key-side, so the all-gather fallback runs it
    half:      hand-written causal window of half the sequence (t // 2: a size computed from
               the length, which a trace of one rank's share reads as a number)
    """

    def __init__(self, mode: str, vocab: int = 32, width: int = 16, heads: int = 2, window: int = 6):
        super().__init__()
        self.mode, self.heads, self.window = mode, heads, window
        self.emb, self.qkv = nn.Embedding(vocab, width), nn.Linear(width, 3 * width)
        self.proj, self.head = nn.Linear(width, width), nn.Linear(width, vocab)
        self.register_buffer("slopes", torch.tensor([2.0 ** -(h + 1) for h in range(heads)]))

    def forward(self, idx, attention_mask=None):
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)   # [b, h, t, d]
        i = torch.arange(t, device=idx.device)
        causal = i[None, :] <= i[:, None]                                          # [t, t] visible
        if self.mode == "pad_sdpa":
            keep = causal[None, None] & attention_mask[:, None, None, :].bool()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        elif self.mode == "pad_query":   # padded queries see key 0 only: a mask over queries
            keep = causal[None, None] & (attention_mask[:, None, :, None].bool() | (i == 0))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5)
            if self.mode == "alibi":
                s = s + self.slopes[:, None, None] * (i[None, :] - i[:, None]).float()
            if self.mode in ("window", "half"):
                window = self.window if self.mode == "window" else t // 2
                causal = causal & (i[None, :] > i[:, None] - window)
            s = s.masked_fill(~causal, float("-inf"))
            if self.mode == "pad_hand":
                s = s + (1.0 - attention_mask[:, None, None, :]) * -1e9
            y = torch.softmax(s, -1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def masked_workload(mode: str, seq: int = 16, batch: int = 4) -> dict:
    torch.manual_seed(0)
    model = MaskedAttention(mode)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (batch, seq + 1), generator=g)
    inputs = (idx[:, :-1],)
    if mode.startswith("pad"):
        mask = torch.ones(batch, seq)
        mask[1, 11:] = 0      # right padding: rows 1 and 3 end early (every query keeps key 0)
        mask[3, 5:] = 0
        inputs += (mask,)
    return {"model": model, "inputs": inputs, "target": idx[:, 1:], "loss_fn": lm_loss}


class Mixing(nn.Module):
    """Ops with no ring form that take the all-gather fallback: `mode` cumsum (a running mean
    over time added to each position), conv (a non-causal conv1d over time), pool (mean over
    the sequence -> a classifier: the target has no sequence dim; partial sums all-reduced, not
    gathered: runtime/cp_gather.reduce_seq), kmax (k-max pooling,
    topk(x, 2, dim=1) over time, added back to every position), sort (values sorted over
    time, indices used too), cumprod / logcumsumexp (scans over time); and position-wise
    ones cp must keep local: router (topk(k=2, dim=-1) over [tokens, 4 experts], a
    top-2 mixture of expert projections), gqa (SDPA enable_gqa=True, 4 query heads on 2 kv
    heads, causal), route (a top-2 MoE: token-expert rows argsorted by expert over the merged
    [b*t*2] dim, a grouped matmul, index_add back: this rank's rows alone); route_leak (the
    same sorted rows read back as if they were positions: refused)."""

    def __init__(self, mode: str, vocab: int = 32, width: int = 16):
        super().__init__()
        self.mode = mode
        self.emb, self.mix, self.head = nn.Embedding(vocab, width), nn.Linear(width, width), nn.Linear(width, vocab)
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.router, self.expert_proj = nn.Linear(width, 4), nn.Linear(width, 4 * width)
        self.q, self.kv = nn.Linear(width, width), nn.Linear(width, width)
        self.w_experts = nn.Parameter(torch.randn(4, width, width) * width ** -0.5)

    def forward(self, idx):
        x = self.emb(idx)
        if self.mode == "cumsum":
            x = x + torch.tanh(self.mix(torch.cumsum(x, dim=1)))
        elif self.mode == "conv":
            x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        elif self.mode == "kmax":
            top = torch.topk(x, 2, dim=1).values                         # [b, 2, w]: the 2 largest over time
            x = x + torch.tanh(self.mix(top.mean(dim=1, keepdim=True)))
        elif self.mode == "sort":
            vals, idx = torch.sort(self.mix(x), dim=1, descending=True)  # [b, t, w] sorted over time
            x = x + torch.tanh(vals) + 0.01 * idx.float()
        elif self.mode == "cumprod":
            x = x + torch.cumprod(torch.sigmoid(self.mix(x)), dim=1)
        elif self.mode == "logcumsumexp":
            x = x + torch.logcumsumexp(self.mix(x), dim=1) * 0.1
        elif self.mode == "cummax":
            x = x + torch.tanh(self.mix(torch.cummax(x, dim=1).values))   # a running max over time
        elif self.mode == "router":
            tokens = x.reshape(-1, x.shape[-1])                                        # [b*t, w]
            w, sel = torch.topk(torch.softmax(self.router(tokens), dim=-1), k=2, dim=-1)   # [b*t, 2]
            ex = self.expert_proj(tokens).view(tokens.shape[0], 4, -1)                     # [b*t, 4, w]
            picked = torch.gather(ex, 1, sel[..., None].expand(*sel.shape, ex.shape[-1]))
            x = x + (w[..., None] * picked).sum(dim=1).view(x.shape)
        elif self.mode in ("route", "route_leak"):
            tokens = x.reshape(-1, x.shape[-1])                                        # [b*t, w]
            gate, expert = torch.topk(torch.softmax(self.router(tokens), dim=-1), k=2, dim=-1)
            order = expert.reshape(-1).argsort(stable=True)                            # rows by expert
            rows = tokens[order // 2]
            if self.mode == "route_leak":
                return self.head(x + rows[::2].view(x.shape))                          # sorted rows as positions
            offs = F.one_hot(expert.reshape(-1), 4).sum(0).cumsum(0).to(torch.int32)
            y = torch.ops.zoo_moe.gmm(rows, self.w_experts, offs) * gate.reshape(-1)[order].unsqueeze(-1)
            x = x + torch.zeros_like(tokens).index_add(0, order // 2, y).view(x.shape)
        elif self.mode == "gqa":
            b, t, c = x.shape
            q = self.q(x).view(b, t, 4, c // 4).transpose(1, 2)                      # [b, 4, t, d]
            k, v = self.kv(x).view(b, t, 2, c // 2).transpose(1, 2).split(c // 4, dim=-1)   # [b, 2, t, d]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + y.transpose(1, 2).reshape(b, t, c)
        else:
            x = self.mix(x).mean(dim=1)
        return self.head(x)


def mixing_workload(mode: str, seq: int = 16, batch: int = 4) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (batch, seq + 1), generator=g)
    target = idx[:, 0] if mode == "pool" else idx[:, 1:]
    return {"model": Mixing(mode), "inputs": (idx[:, :-1],), "target": target,
            "loss_fn": (lambda y, t: F.cross_entropy(y, t)) if mode == "pool" else lm_loss}


class _WithMask(nn.Module):
    """An HF causal LM called with input_ids and attention_mask: its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def hf_llama_padded(attn: str = "eager", seq: int = 16, batch: int = 4) -> dict:
    """HF Llama (examples/hf.py) with an attention_mask input, rows 1 and 3 right-padded."""
    from examples.hf import llama
    w = llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, intermediate=64, seq=seq, batch=batch, attn=attn)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 11:] = 0
    mask[3, 5:] = 0
    return {**w, "model": _WithMask(w["model"].model), "inputs": w["inputs"] + (mask,)}


class PositionTables(nn.Module):
    """Position-dependent values found by data flow, each sliced to the traced length T:
    `mode` learned (a learned table of 32 rows, `x + self.pos[:T]`), ids (a buffer of
    position ids [1, 32] sliced [:, :T] -> an embedding, as BERT writes it), rotary (cos/sin
    caches of 32 rows built in __init__ with outer + cat, sliced [:T], as HF's older rotary
    embeddings did); whole (a learned table of exactly the sequence's 16 positions added whole,
    `x + self.vit_pos`, as every ViT does: its width is 16 too, so only the trace tells which
    dim is the positions'). A causal attention layer after it mixes positions."""

    def __init__(self, mode: str, vocab: int = 32, width: int = 16, rows: int = 32):
        super().__init__()
        self.mode = mode
        self.emb, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.pos = nn.Parameter(torch.randn(rows, width) * 0.1)
        self.pos_emb = nn.Embedding(rows, width)
        self.vit_pos = nn.Parameter(torch.randn(1, 16, width) * 0.1)
        self.register_buffer("position_ids", torch.arange(rows)[None], persistent=False)
        freqs = torch.outer(torch.arange(rows).float(), 1.0 / 100 ** (torch.arange(0, width, 2).float() / width))
        ang = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", ang.cos(), persistent=False)
        self.register_buffer("sin_cached", ang.sin(), persistent=False)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        if self.mode == "learned":
            x = x + self.pos[:t]
        elif self.mode == "ids":
            x = x + self.pos_emb(self.position_ids[:, :t])
        elif self.mode == "whole":
            x = x + self.vit_pos
        else:
            half = x.shape[-1] // 2
            rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            x = x * self.cos_cached[:t] + rot * self.sin_cached[:t]
        q, k, v = self.qkv(x).view(b, t, 3, 2, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))


def position_workload(mode: str, seq: int = 16, batch: int = 2) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (batch, seq + 1), generator=g)
    return {"model": PositionTables(mode), "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}
