"""A tiny T5-style model: attention with a learned relative-position bias (T5's buckets ->
embedding -> [1, heads, t, t]) computed once and added to the scores of both layers.
Importable by spawned ranks (tests/cp_bias_jobs.py)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RelBiasLM(nn.Module):
    """Embedding -> 2 attention layers sharing one learned relative-position bias -> head.

    bi_pad:  bidirectional buckets (T5's encoder), the bias summed with a key padding mask
             from attention_mask [B, S] before it meets the scores (T5's position_bias + mask)
    causal:  unidirectional buckets (T5's decoder) and a causal masked_fill on the scores
    sdpa:    bidirectional buckets, each layer its own table, SDPA with the bias as attn_mask
    """

    def __init__(self, mode: str, vocab: int = 32, width: int = 16, heads: int = 2, buckets: int = 10,
                 max_distance: int = 20):
        super().__init__()
        self.mode, self.heads, self.buckets, self.max_distance = mode, heads, buckets, max_distance
        self.emb, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width, bias=False) for _ in range(2))
        self.proj = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(2))
        self.rel = nn.Embedding(buckets, heads)
        if mode == "sdpa":
            self.rel2 = nn.Embedding(buckets, heads)

    def bucket(self, rel: torch.Tensor) -> torch.Tensor:
        """T5's relative position buckets: exact below max_exact, log-spaced up to max_distance."""
        nb, out = self.buckets, torch.zeros_like(rel)
        if self.mode == "causal":
            rel = -torch.min(rel, torch.zeros_like(rel))
        else:
            nb //= 2
            out = out + (rel > 0).to(torch.long) * nb
            rel = torch.abs(rel)
        exact = nb // 2
        far = exact + (torch.log(rel.float() / exact) / math.log(self.max_distance / exact) * (nb - exact)).to(torch.long)
        far = torch.min(far, torch.full_like(far, nb - 1))
        return out + torch.where(rel < exact, rel, far)

    def forward(self, idx, attention_mask=None):
        b, t = idx.shape
        x = self.emb(idx)
        i = torch.arange(t, device=idx.device)
        bias = self.rel(self.bucket(i[None, :] - i[:, None])).permute(2, 0, 1).unsqueeze(0)   # [1, h, t, t]
        if attention_mask is not None:
            bias = bias + (1.0 - attention_mask[:, None, None, :]) * -1e9
        for layer, (qkv, proj) in enumerate(zip(self.qkv, self.proj)):
            q, k, v = qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)   # [b, h, t, d]
            if self.mode == "sdpa":
                if layer:
                    bias = self.rel2(self.bucket(i[None, :] - i[:, None])).permute(2, 0, 1).unsqueeze(0)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
            else:
                s = q @ k.transpose(-2, -1) + bias   # T5: no 1/sqrt(d)
                if self.mode == "causal":
                    s = s.masked_fill(~(i[None, :] <= i[:, None]), float("-inf"))
                y = torch.softmax(s, -1) @ v
            x = x + proj(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def relbias_workload(mode: str, seq: int = 16, batch: int = 4) -> dict:
    torch.manual_seed(0)
    model = RelBiasLM(mode)
    with torch.no_grad():
        for table in (model.rel, getattr(model, "rel2", model.rel)):
            table.weight.mul_(4.0)   # a bias that matters next to the scores
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (batch, seq + 1), generator=g)
    inputs = (idx[:, :-1],)
    if mode.endswith("pad"):
        mask = torch.ones(batch, seq)
        mask[1, 11:] = 0      # right padding over keys
        mask[3, 5:] = 0
        inputs += (mask,)
    return {"model": model, "inputs": inputs, "target": idx[:, 1:], "loss_fn": lm_loss}


def sgd_losses_and_grads(step_fn, named, steps: int) -> tuple[list, list]:
    """`steps` SGD steps (lr 0.1): the loss of each and every parameter's gradient before each
    update, by name. step_fn() runs forward and backward and returns the loss."""
    params = dict(named)
    opt = torch.optim.SGD(list(params.values()), lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(step_fn()))
        grads.append({k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None})
        opt.step()
    return losses, grads


def one_process(mode: str, steps: int) -> tuple[list, list]:
    w = relbias_workload(mode)
    m = w["model"]

    def step():
        loss = w["loss_fn"](m(*w["inputs"]), w["target"])
        loss.backward()
        return loss.item()
    return sgd_losses_and_grads(step, m.named_parameters(), steps)
