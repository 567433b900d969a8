"""Models whose input-free values along the sequence are read at fixed positions or along the
sequence (passes/cp_free_whole.py), for tests/test_cp_free_whole.py."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.cp_factory_models import factory_workload, lm_loss, parallel, reference  # noqa: F401  (the tests read them here)


class PackedCheck(nn.Module):
    """Position ids from arange, then a packed-sequence check as HF writes it (the first id
    minus one prepended, `diff`, `!= 1`, `cumsum`: segment ids), positions relative to the
    first one (`pos - pos[:, :1]`) and their span (`max - min`), each read into the tokens;
    causal attention."""

    def __init__(self, vocab: int = 32, width: int = 16, heads: int = 2, longest: int = 64):
        super().__init__()
        self.heads = heads
        self.emb, self.seg = nn.Embedding(vocab, width), nn.Embedding(4, width)
        self.pos = nn.Embedding(longest, width)
        self.qkv, self.proj, self.head = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, idx):
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).unsqueeze(0).expand(b, -1)
        seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        span = (pos.max() - pos.min() + 1).float()
        x = self.emb(idx) + self.seg(seg) + self.pos(pos - pos[:, :1]) * span.rsqrt()
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class CutScores(nn.Module):
    """s[..., :t - 1] of attention weights computed whole (RelPosAttention's grid of relative
    positions): the weight on every key but the last, a bound of the length."""

    def __init__(self):
        super().__init__()
        self.inner = factory_workload("relpos")["model"]

    def forward(self, idx):
        m = self.inner
        b, t = idx.shape
        x = m.emb(idx)
        q, k, v = m.qkv(x).view(b, t, 3, m.heads, -1).permute(2, 0, 3, 1, 4)
        s = torch.softmax(q @ k.transpose(-2, -1), -1)
        mass = s[..., : t - 1].sum(-1, keepdim=True)
        return m.head(x + m.proj((s @ v * mass).transpose(1, 2).reshape(b, t, -1)))


def cut_workload() -> dict:
    return {**factory_workload("relpos"), "model": CutScores()}


def packed_workload(seq: int = 16, batch: int = 2) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (batch, seq + 1), generator=g)
    return {"model": PackedCheck(), "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}


WORKLOADS = {"packed": packed_workload, "cut": cut_workload}


def packed_parity(plan: str, steps: int = 3, names: tuple = ("packed",)):
    """Run on every rank: each workload of `names` under `plan`, (losses, grads)."""
    torch.set_num_threads(1)
    out = [parallel(WORKLOADS[n](), plan, steps) for n in names]
    return out[0] if len(names) == 1 else out
