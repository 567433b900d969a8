"""Small models whose per-position values come from a factory made in forward at the traced
length (passes/cp_factories.py), and the jobs their cp parity tests launch (importable by
spawned ranks).

`FactoryPositions(mode)`, each after an embedding and before a causal attention layer:
    cumsum:  OPT's positions: mask = ones(b, t); pos = cumsum(mask, 1) * mask - 1, + an
             offset of 2, looked up in a learned position table
    scale:   DeBERTa's embeddings: x * ones(b, t).unsqueeze(-1) (a mask made when none is given)
    running: a running mean over time, x.cumsum(1) / full((b, t, 1), 1.0).cumsum(1)
and `TailAlibi` ("alibi_tail"): MPT's ALiBi, a table [heads, 1, L] of slope * (j - L + 1)
built in forward and sliced to its last t keys (`bias[:, :, L - t:]`), added to the scores;
`FeatureProbe` ("seq_probe"): an input [2, 16, 16] whose sequence and feature dims are both
divisible by 2*cp, read by a linear layer over its last dim and a causal attention;
`RelPosAttention` ("relpos"): DeBERTa's disentangled attention in small, scores q k^T + c2p with
c2p = gather(q R^T, -1, clamp(i - j + K, 0, 2K - 1)) and a ones mask made in forward paired
as mask[:, None, :, None] * mask[:, None, None, :]: grids of positions the ring does not take,
computed whole on every rank (passes/cp_whole.py); "t5bias": T5's in small, a learned bias
per head looked up at clamp(j - i) plus an all-visible mask over queries expanded over keys
(where(mask, 0, finfo.min)), which is widened to the whole keys beside the whole bias.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MODES = ["cumsum", "scale", "running", "alibi_tail", "seq_probe", "relpos", "t5bias"]


class FactoryPositions(nn.Module):
    def __init__(self, mode: str, vocab: int = 32, width: int = 16, rows: int = 40):
        super().__init__()
        self.mode = mode
        self.emb, self.pos = nn.Embedding(vocab, width), nn.Embedding(rows, width)
        self.qkv, self.proj, self.head = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        if self.mode == "cumsum":
            mask = torch.ones(b, t, device=idx.device)
            pos = (torch.cumsum(mask, dim=1) * mask - 1).long()
            x = x + self.pos(pos + 2)
        elif self.mode == "scale":
            mask = torch.ones(b, t, device=idx.device)
            x = x * mask.unsqueeze(-1).to(x.dtype)
        else:
            count = torch.full((b, t, 1), 1.0, device=idx.device).cumsum(1)
            x = x + x.cumsum(1) / count
        q, k, v = self.qkv(x).view(b, t, 3, 2, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class TailAlibi(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16, heads: int = 2, longest: int = 40):
        super().__init__()
        self.heads, self.longest = heads, longest
        self.emb, self.qkv = nn.Embedding(vocab, width), nn.Linear(width, 3 * width)
        self.proj, self.head = nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        slopes = 1.0 / 2 ** torch.arange(1, self.heads + 1, device=idx.device).float()
        bias = torch.arange(1 - self.longest, 1, device=idx.device).view(1, 1, -1) * slopes.view(-1, 1, 1)
        bias = bias[:, max(0, bias.size(1) - t):, max(0, bias.size(2) - t):]      # [heads, 1, t]
        s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5) + bias
        i = torch.arange(t, device=idx.device)
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
        y = torch.softmax(s, -1) @ v
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class RelPosAttention(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 12, heads: int = 2, span: int = 3, t5: bool = False):
        super().__init__()
        self.heads, self.span, self.t5 = heads, span, t5
        self.bias = nn.Embedding(2 * span, heads)
        self.emb, self.qkv = nn.Embedding(vocab, width), nn.Linear(width, 3 * width)
        self.proj, self.head = nn.Linear(width, width), nn.Linear(width, vocab)
        self.rel = nn.Parameter(torch.randn(2 * span, width // heads) * 0.3)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)    # [b, h, t, d]
        i = torch.arange(t, device=idx.device)
        rel = torch.clamp(i[:, None] - i[None, :] + self.span, 0, 2 * self.span - 1)  # [t, t]
        if self.t5:
            visible = (i >= 0)[None, None, :, None].expand(b, 1, t, t)
            s = q @ k.transpose(-2, -1) + self.bias(rel).permute(2, 0, 1)[None] \
                + torch.where(visible, 0.0, torch.finfo(q.dtype).min)
            y = torch.softmax(s, -1) @ v
            return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        c2p = torch.gather(q @ self.rel.T, -1, rel.expand(b, self.heads, t, t))
        mask = torch.ones(b, t, device=idx.device)
        pair = mask[:, None, :, None] * mask[:, None, None, :]
        s = (q @ k.transpose(-2, -1) + c2p) * (q.shape[-1] ** -0.5)
        s = s.masked_fill(pair == 0, float("-inf"))
        y = torch.softmax(s, -1) @ v
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class FeatureProbe(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(torch.tanh(y.transpose(1, 2).reshape(b, t, -1)))


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def factory_workload(mode: str, seq: int = 16, batch: int = 2) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (batch, seq + 1), generator=g)
    if mode == "seq_probe":
        x = torch.randn(batch, seq, 16, generator=g)
        return {"model": FeatureProbe(), "inputs": (x,), "target": torch.randn(batch, seq, 16, generator=g),
                "loss_fn": F.mse_loss}
    model = TailAlibi() if mode == "alibi_tail" else RelPosAttention(t5=mode == "t5bias") if mode in ("relpos", "t5bias") \
        else FactoryPositions(mode)
    return {"model": model, "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}


def losses_and_grads(step, params, steps: int, lr: float = 0.1, make_opt=None):
    """`steps` SGD steps: (the loss of each, each step's gradients by parameter name)."""
    opt = make_opt(torch.optim.SGD, lr=lr) if make_opt else torch.optim.SGD([p for _, p in params], lr=lr)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(step()))
        grads.append({k: p.grad.detach().clone() for k, p in params if p.grad is not None})
        opt.step()
    return losses, grads


def reference(w: dict, steps: int = 3):
    model = w["model"]

    def step():
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        return loss.item()
    return losses_and_grads(step, list(model.named_parameters()), steps)


def parallel(w: dict, plan: str, steps: int = 3):
    import threefold
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    return losses_and_grads(lambda: pm.step(*w["inputs"], target=w["target"]), list(pm.named_parameters()),
                            steps, make_opt=pm.optimizer)


def factory_parity(modes: list, plan: str, steps: int = 3) -> list:
    """Run on every rank: each FactoryPositions mode under `plan`, (losses, grads)."""
    torch.set_num_threads(1)
    return [parallel(factory_workload(m), plan, steps) for m in modes]


def zoo_grads_parity(archs: list, plan: str, steps: int = 3, seq: int | None = None) -> dict:
    """Run on every rank: each zoo arch (batch 2, `seq` positions where given) under `plan`,
    (losses, grads)."""
    from tests.cp_jobs import zoo_batch2
    torch.set_num_threads(1)
    return {a: parallel(zoo_batch2(a, seq), plan, steps) for a in archs}


def grad_diff(got: list, ref: list) -> float:
    """The largest gradient difference over the steps and parameters, relative to the
    largest gradient of that parameter or, where that is rounding noise (a key bias, whose
    gradient is 0 in exact arithmetic: softmax ignores a shift per query), to 1e-3 of the
    step's largest gradient. Missing or extra gradients are infinitely off."""
    worst = 0.0
    for g, r in zip(got, ref):
        if set(g) != set(r):
            return float("inf")
        floor = 1e-3 * max(v.abs().max().item() for v in r.values())
        for k in r:
            worst = max(worst, ((g[k] - r[k]).abs().max() / max(r[k].abs().max().item(), floor)).item())
    return worst


def assert_zoo_archs_match(got: list, archs: list) -> None:
    """Every rank's (losses, grads) per zoo arch equal one process's on zoo_batch2(arch)."""
    from tests.cp_jobs import zoo_batch2
    from tests.parity import max_rel_diff
    for arch in archs:
        ref_losses, ref_grads = reference(zoo_batch2(arch))
        for rank in got:
            losses, grads = rank[arch]
            assert max_rel_diff(losses, ref_losses) < 1e-5, (arch, losses, ref_losses)
            assert grad_diff(grads, ref_grads) < 1e-5, (arch, grad_diff(grads, ref_grads))
