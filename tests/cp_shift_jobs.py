"""Token shifts along the sequence under cp (runtime/cp_shift.py, passes/cp_shifts.py): the
workload and the jobs the multi-rank tests run on local gloo ranks."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ShiftMix(nn.Module):
    """Token shifts as models write them, mixed into the residual stream: RWKV's
    ZeroPad2d((0, 0, 1, -1)), cat([zeros_like(x[:, :1]), x[:, :-1]]), F.pad(x[:, :-2]) (by 2)
    and a look-ahead F.pad(x[:, 1:], (0, 0, 0, 1)) (by -1)."""

    def __init__(self, vocab: int = 32, width: int = 8):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.key = nn.Linear(width, width)
        self.mix = nn.Parameter(torch.rand(4, width))

    def forward(self, idx):
        x = self.emb(idx)                                             # [b, s, w]
        k = self.key(x)
        a = self.time_shift(x)
        b = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)
        c = F.pad(x[:, :-2], (0, 0, 2, 0))
        d = F.pad(k[:, 1:], (0, 0, 0, 1))
        h = x + self.mix[0] * a + self.mix[1] * b + self.mix[2] * c + self.mix[3] * d
        return self.head(torch.tanh(h))


def _lm(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def shift_workload(seq: int = 16) -> dict:
    torch.manual_seed(0)
    idx = torch.randint(0, 32, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    return {"model": ShiftMix(), "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": _lm}


def sgd_trace(step_fn, named, steps: int, lr: float = 0.1) -> list:
    """(loss, {name: grad}) before each of `steps` SGD updates."""
    out = []
    for _ in range(steps):
        loss = step_fn()
        grads = {k: p.grad.detach().clone() for k, p in named()}
        with torch.no_grad():
            for _, p in named():
                p -= lr * p.grad
                p.grad = None
        out.append((loss, grads))
    return out


def reference_trace(steps: int = 3) -> list:
    w = shift_workload()
    model = w["model"]

    def step():
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        return loss.item()
    return sgd_trace(step, model.named_parameters, steps)


def shift_parity(cp: int, steps: int = 3) -> list:
    """The same trace under plan cp=N, on this rank."""
    import threefold
    torch.set_num_threads(1)
    w = shift_workload()
    pm = threefold.parallelize(w["model"], f"cp={cp}", w["inputs"], w["loss_fn"], target=w["target"])
    return sgd_trace(lambda: pm.step(*w["inputs"], target=w["target"]), pm.named_parameters, steps)


def halo_checks(cp: int, seq: int = 16) -> list:
    """shift_seq on this rank's blocks against the whole-sequence shift, forward and backward
    (float64), for shifts by 1, 2, a whole block and back by 1 and by a block, along dims 1 and 2."""
    import torch.distributed as dist
    from threefold.runtime.cp_ops import local_blocks
    from threefold.runtime.cp_shift import shift_seq
    torch.set_num_threads(1)
    r, group, b = dist.get_rank(), dist.group.WORLD, seq // (2 * cp)
    out = []
    for dim in (1, 2):
        for k in (1, 2, b, -1, -b):
            g = torch.Generator().manual_seed(abs(k) * 10 + dim)
            shape = [3, 4, 5]
            shape[dim] = seq
            x = torch.randn(shape, dtype=torch.float64, generator=g, requires_grad=True)
            up = torch.randn(shape, dtype=torch.float64, generator=g)
            whole = shift_seq(x, k, dim, None)
            (whole * up).sum().backward()
            mine = local_blocks(x.detach(), dim, cp, r).requires_grad_(True)
            got = shift_seq(mine, k, dim, group, ranks=cp)
            (got * local_blocks(up, dim, cp, r)).sum().backward()
            out.append({"k": k, "dim": dim,
                        "forward": (got - local_blocks(whole.detach(), dim, cp, r)).abs().max().item(),
                        "backward": (mine.grad - local_blocks(x.grad, dim, cp, r)).abs().max().item()})
    return out
