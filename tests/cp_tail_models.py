"""Models that shorten the sequence inside forward (passes/cp_tails.py), for
tests/test_cp_tails.py: they take the whole token row and shift it themselves."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.cp_factory_models import losses_and_grads, reference  # noqa: F401  (the tests read reference here)


class SelfShiftLM(nn.Module):
    """logits[:, :-1] against labels x[:, 1:] inside forward (-100 ignored), causal attention;
    `form` "ce": F.cross_entropy over the flattened tokens (mean over the labels that count),
    "sum": the per-token terms written out, summed and divided by their count (x-transformers'
    AutoregressiveWrapper), "leak": the shortened logits averaged over the sequence (partial
    sums without the dropped position), "softmax": a softmax over them (mixes positions: refused), "mse": a mean over elements of the shortened sequence (refused: its
    element count is a number traced at the local length)."""

    def __init__(self, form: str, vocab: int = 32, width: int = 16, heads: int = 2):
        super().__init__()
        self.form, self.heads = form, heads
        self.emb, self.qkv = nn.Embedding(vocab, width), nn.Linear(width, 3 * width)
        self.proj, self.head = nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, x):
        b, t = x.shape
        h = self.emb(x.clamp(min=0))
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(h + self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        logits, labels = logits[:, :-1], x[:, 1:]
        if self.form == "ce":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        if self.form == "leak":   # pooled over the shortened positions: reduce_seq without the tail
            return logits.mean(1).logsumexp(-1).mean()
        if self.form == "softmax":   # a softmax over the shortened positions: refused
            return logits.softmax(1).logsumexp(-1).mean()
        if self.form == "mse":   # a mean over the elements: their count was traced at the local length
            return F.mse_loss(logits[..., :1], labels[..., None].float())
        keep = labels != -100
        nll = logits.logsumexp(-1) - logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return torch.where(keep, nll, 0.0).sum() / keep.sum()


def own_loss(loss, target):
    return loss


def tail_workload(form: str, seq: int = 16, batch: int = 2) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32, (batch, seq), generator=g)
    x[0, 5] = -100   # an ignored label: the denominator counts the labels that are not
    return {"model": SelfShiftLM(form), "inputs": (x,), "target": x[:, 1:], "loss_fn": own_loss,
            "batch_dims": (0, 0)}


def parallel(w: dict, plan: str, steps: int = 3):
    import threefold
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"],
                               batch_dims=w.get("batch_dims"))
    return losses_and_grads(lambda: pm.step(*w["inputs"], target=w["target"]), list(pm.named_parameters()),
                            steps, make_opt=pm.optimizer)


def tail_parity(forms: list, plan: str, steps: int = 3) -> list:
    """Run on every rank: each SelfShiftLM form under `plan`, (losses, grads)."""
    torch.set_num_threads(1)
    return [parallel(tail_workload(f), plan, steps) for f in forms]


def zoo_tail_parity(arch: str, plan: str, steps: int = 3, seq: int | None = None):
    """Run on every rank: a zoo arch (2 rows, `seq` positions where given) under `plan`, (losses, grads)."""
    from tests.cp_jobs import zoo_batch2
    torch.set_num_threads(1)
    return parallel(zoo_batch2(arch, seq), plan, steps)
