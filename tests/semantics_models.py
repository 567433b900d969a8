"""Tiny hand-written models for the semantics tests (loss forms, batch dims, frozen
parameters, in-place ops on received values). Each factory returns a workload dict built
from a fixed seed, so every process builds the same weights."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import threefold

V, H = 13, 16


class TinyLM(nn.Module):
    """Embedding -> 2 residual MLP blocks -> vocab head; `h += skip` writes in place."""

    def __init__(self, split: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.fc1 = nn.Linear(H, H)
        self.fc2 = nn.Linear(H, H)
        self.head = nn.Linear(H, V)
        self.split = split

    def forward(self, ids):                       # ids [B, S]
        h = self.emb(ids)
        skip = h
        h = self.fc1(h)
        if self.split:
            threefold.pipe_split()                # stage 1 receives h and skip
        h += skip                                 # in place on a received tensor
        h = torch.tanh(h)
        h = torch.relu(self.fc2(h).clamp_(max=5.0))   # OLMo-style clamp_
        return self.head(h)                       # [B, S, V]


def _batch(seed: int = 1, b: int = 4, s: int = 6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    labels = torch.randint(0, V, (b, s), generator=g)
    # BERT-MLM style: most positions ignored, and rows have different valid counts
    keep = torch.zeros(b, s, dtype=torch.bool)
    for r in range(b):
        keep[r, : r + 1 if r < b - 1 else s] = True
    labels[~keep] = -100
    return ids, labels


def mlm(split=False, **_):
    torch.manual_seed(0)
    ids, labels = _batch()
    return {"model": TinyLM(split), "inputs": (ids,), "target": labels,
            "loss_fn": lambda out, t: F.cross_entropy(out.reshape(-1, V), t.reshape(-1))}


def sum_loss(split=False, **_):
    torch.manual_seed(0)
    ids, labels = _batch()
    labels = labels.clamp(min=0)
    return {"model": TinyLM(split), "inputs": (ids,), "target": labels,
            "loss_fn": lambda out, t: F.cross_entropy(out.reshape(-1, V), t.reshape(-1), reduction="sum")}


def frozen(split=False, **_):
    w = mlm(split)
    w["model"].emb.weight.requires_grad_(False)
    w["model"].fc1.bias.requires_grad_(False)
    return w


class SeqFirstClassifier(nn.Module):
    """nn.TransformerEncoder with batch_first=False: input [seq, batch, hidden]."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(H, 2, 32, dropout=0.0, batch_first=False)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.cls = nn.Linear(H, 3)

    def forward(self, x):                         # x [S, B, H]
        return self.cls(self.enc(x).mean(0))      # [B, 3]


def seq_first(**_):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, H, generator=g)
    y = torch.randint(0, 3, (4,), generator=g)
    return {"model": SeqFirstClassifier(), "inputs": (x,), "target": y, "loss_fn": F.cross_entropy}


FACTORIES = {"mlm": mlm, "sum": sum_loss, "frozen": frozen, "seq_first": seq_first}


def reference(name: str, steps: int, lr: float = 0.1, **kw) -> list[float]:
    from tests.parity import sgd_losses
    return sgd_losses(FACTORIES[name](**kw), steps, lr)


def microbatch_mean_reference(name: str, parts: int, **kw) -> float:
    """What the old engine reported: the mean of per-microbatch losses (first step)."""
    w = FACTORIES[name](**kw)
    (x,), t = w["inputs"], w["target"]
    with torch.no_grad():
        losses = [w["loss_fn"](w["model"](xc), tc) for xc, tc in zip(x.chunk(parts), t.chunk(parts))]
    return float(sum(losses) / parts)


def run_cases(cases: list[tuple[str, dict, str]], steps: int, lr: float = 0.1) -> list[dict]:
    """On every rank: for each (factory, kwargs, plan), train `steps` SGD steps."""
    torch.set_num_threads(1)
    results = []
    for name, kw, plan in cases:
        w = FACTORIES[name](**kw)
        frozen_before = {n: p.detach().clone() for n, p in w["model"].named_parameters()
                         if not p.requires_grad}
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"],
                                   batch_dims=w.get("batch_dims"))
        from tests.parity import parallel_sgd_losses
        losses = parallel_sgd_losses(pm, w, steps, lr)
        local = dict(pm.engine.params)
        frozen_ok = all(torch.equal(local[n], v) and local[n].grad is None and not local[n].requires_grad
                        for n, v in frozen_before.items() if n in local)
        results.append({"case": name, "plan": plan, "losses": losses,
                        "trainable": sorted(n for n, _ in pm.named_parameters()),
                        "frozen_ok": frozen_ok, "manifest_frozen": pm.manifest.get("frozen"),
                        "batch_dims": pm.manifest.get("batch_dims"), "loss": pm.manifest.get("loss")})
    return results


class DropoutMLP(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.a, self.b, self.p = nn.Linear(16, 32), nn.Linear(32, 5), p

    def forward(self, x):
        return self.b(F.dropout(torch.relu(self.a(x)), self.p, self.training))


def dropout_mlp(p: float = 0.3):
    """For `threefold check` with and without random ops."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    return {"model": DropoutMLP(p), "inputs": (torch.randn(16, 16, generator=g),),
            "target": torch.randint(0, 5, (16,), generator=g), "loss_fn": F.cross_entropy}
