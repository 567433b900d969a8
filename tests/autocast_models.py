"""A tiny LM with regions under torch.autocast inside forward: a bf16 block, and inside it
a block a library keeps fp32 (`torch.autocast(..., enabled=False)`), as decorators do."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H = 13, 16


class AutocastLM(nn.Module):
    def __init__(self, enabled_region: bool = True):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V)
        self.enabled_region = enabled_region

    def forward(self, ids):                               # ids [B, S]
        h = self.emb(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled_region):
            u = F.gelu(self.fc1(h))                       # bf16 under the region
            h = h + self.fc2(u)                           # bf16 + fp32 -> fp32
            with torch.autocast("cpu", enabled=False):    # kept fp32, as a library's decorator does
                h = self.norm(h.float())
        return self.head(h)                               # [B, S, V]


def workload(enabled_region: bool = True, **_):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, 6), generator=g)
    labels = torch.randint(0, V, (4, 6), generator=g)
    return {"model": AutocastLM(enabled_region), "inputs": (ids,), "target": labels,
            "loss_fn": lambda out, t: F.cross_entropy(out.reshape(-1, V), t.reshape(-1))}


def run_plans(plans: list[str], steps: int, lr: float = 0.1) -> list[list[float]]:
    """On every rank: the losses of `steps` SGD steps under each plan."""
    import threefold
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    out = []
    for plan in plans:
        w = workload()
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        out.append(parallel_sgd_losses(pm, w, steps, lr))
    return out
