"""Sequences of a length 2*cp does not divide (passes/cp_padding.py), for
tests/test_cp_uneven.py: the sequence is padded to 2cp blocks at the runtime's cut, and what
mixes positions leaves the padding out.

`Encoder(form)`: an embedding, a learned position table of exactly `seq` rows sliced to the
input's length (`pos[:t]`: the padded positions would read past its end), NON-causal SDPA
(every real query sees every real key, so a padded key must be hidden), then
    "pool":   a mean over the sequence and a classifier per row (the mean counts the real
              positions only: the all-gather fallback leaves the padding out);
    "tokens": a per-token cross-entropy (mean over the labels that count);
    "mse":    a per-token mean squared error (a mean over elements: its count, traced at the
              padded length, is scaled to the real one);
    "causal": the same with is_causal=True (the padded keys come after every real query);
    "hflabels": causal, its loss shifting the labels as Hugging Face's does,
              `pad(labels, (0, 1), value=-100)[..., 1:]` (the fill starts before the padding).
`workload("exactgpt@7")`: examples/gpt.py with block_size 7 (its position table and causal mask
buffer hold exactly the real length: the padded positions read row 6, the mask is fitted at 7);
`workload("shift@7")`: tests/cp_shift_jobs.ShiftMix on 7 tokens (a look-ahead shift reads zeros
past the real end, not the padding); `workload("selfshift:ce@15")`: tests/cp_tail_models'
SelfShiftLM on 15 tokens (a shift inside the model on a padded sequence); `workload("packed@7")`:
tests/cp_free_models' packed-sequence check over positions (computed whole at the real length);
`workload("relpos@7")`: tests/cp_factory_models' grid of relative positions (computed whole at 7).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.cp_factory_models import losses_and_grads, reference  # noqa: F401  (the tests read reference here)

FORMS = ["pool", "tokens", "mse", "causal", "hflabels"]


class Encoder(nn.Module):
    def __init__(self, form: str, seq: int, vocab: int = 32, width: int = 16, heads: int = 2, classes: int = 5):
        super().__init__()
        self.form, self.heads = form, heads
        self.emb, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.randn(seq, width) * 0.1)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, classes if form == "pool" else vocab)

    def forward(self, x):
        b, t = x.shape
        h = self.emb(x) + self.pos[:t]
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.form in ("causal", "hflabels"))
        h = h + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        h = h + self.mlp(h)
        if self.form == "pool":
            h = h.mean(1)
        return self.head(h)


class MergedSoftmax(nn.Module):
    """A softmax over every token of the batch at once ([b*t] merged): gathered through its
    digits [b, t], the padding left out of t, run, padded and cut back."""

    def __init__(self, vocab: int = 32, width: int = 8):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, x):
        h = self.emb(x)
        w = h.reshape(-1, h.shape[-1]).softmax(0).reshape(h.shape)
        return self.head(h * w)


class EmbedsIn(nn.Module):
    """Takes embeddings [b, 7, 16]: the feature dim divides 2*cp, the sequence does not; cp tries
    both and keeps the padded sequence (cutting the features fails at the linear layer)."""

    def __init__(self, width: int = 16, classes: int = 5):
        super().__init__()
        self.qkv, self.head = nn.Linear(width, 3 * width), nn.Linear(width, classes)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, w // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(b, t, w))


def embeds_workload() -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return {"model": EmbedsIn(), "inputs": (torch.randn(4, 7, 16, generator=g),),
            "target": torch.randint(0, 5, (4, 7), generator=g),
            "loss_fn": lambda o, t: F.cross_entropy(o.reshape(-1, o.shape[-1]), t.reshape(-1))}


def baked_ratio(out, y):
    """sum(nll * y) / sum(y) with y viewed to its traced size (b * t as numbers): the
    denominator cannot run on the unpadded sequences (refused)."""
    b, t = y.shape
    nll = out.logsumexp(-1).reshape(b * t)
    return (nll * y.reshape(b * t)).sum() / y.reshape(b * t).sum()


def refused(kind: str) -> dict:
    """A workload on 7 tokens that stays refused under cp=2, by kind."""
    torch.manual_seed(0)
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    if kind == "denominator":
        return {"model": Encoder("causal", 7), "inputs": (x,), "target": (x % 2).float(), "loss_fn": baked_ratio}
    return workload({"shortened_mean": "selfshift:mse@15"}[kind])


def loss_for(form: str):
    if form == "pool":
        return lambda out, y: F.cross_entropy(out, y)
    if form == "hflabels":
        def shifted(out, y):
            labels = F.pad(y, (0, 1), value=-100)[..., 1:]
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return shifted
    if form == "mse":
        return lambda out, y: F.mse_loss(out[..., :2], y[..., None].float().expand(*y.shape, 2) / 32)
    return lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=-100)


def encoder_workload(form: str, seq: int = 7, batch: int = 4) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32, (batch, seq), generator=g)
    if form == "pool":
        y = torch.randint(0, 5, (batch,), generator=g)
    else:
        y = torch.randint(0, 32, (batch, seq), generator=g)
        y[0, 2] = -100 if form != "mse" else y[0, 2]   # an ignored label: the denominator counts the others
    return {"model": Encoder(form, seq), "inputs": (x,), "target": y, "loss_fn": loss_for(form)}


def parallel(w: dict, plan: str, steps: int = 3):
    import threefold
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"],
                               batch_dims=w.get("batch_dims"))
    return losses_and_grads(lambda: pm.step(*w["inputs"], target=w["target"]), list(pm.named_parameters()),
                            steps, make_opt=pm.optimizer)


def uneven_parity(names: list, plan: str, steps: int = 3) -> list:
    """Run on every rank: each workload (an Encoder form, or a zoo arch as "zoo:NAME") under
    `plan`, (losses, grads)."""
    torch.set_num_threads(1)
    return [parallel(workload(name), plan, steps) for name in names]


def workload(name: str) -> dict:
    """An Encoder form, a zoo arch as it is ("zoo:NAME") or at 2 rows of `seq` tokens ("zoo:NAME@seq")."""
    if name.startswith("zoo:"):
        from tests.cp_jobs import zoo_batch2
        from tests.zoo import ZOO
        arch, _, seq = name[4:].partition("@")
        return zoo_batch2(arch, int(seq)) if seq else ZOO[arch]()
    name, _, seq = name.partition("@")
    if name == "shift":
        from tests.cp_shift_jobs import shift_workload
        return shift_workload(int(seq))
    if name == "exactgpt":   # examples/gpt.py whose position table and causal-mask buffer have exactly `seq` rows
        from examples.gpt import GPT, GPTConfig, lm_loss
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32, block_size=int(seq), n_layer=2, n_head=2, n_embd=16))
        idx = torch.randint(0, 32, (2, int(seq) + 1), generator=torch.Generator().manual_seed(1))
        return {"model": model, "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}
    if name == "merged":   # a softmax over every token of the batch at once
        torch.manual_seed(0)
        x = torch.randint(0, 32, (2, int(seq)), generator=torch.Generator().manual_seed(1))
        return {"model": MergedSoftmax(), "inputs": (x,), "target": x, "loss_fn": loss_for("tokens")}
    if name == "embeds":
        return embeds_workload()
    if name in ("relpos", "t5bias"):   # a grid of relative positions computed whole (tests/cp_factory_models.py)
        from tests.cp_factory_models import factory_workload
        return factory_workload(name, seq=int(seq))
    if name == "packed":
        from tests.cp_free_models import packed_workload
        return packed_workload(int(seq))
    if name.startswith("selfshift:"):
        from tests.cp_tail_models import tail_workload
        return tail_workload(name.split(":")[1], seq=int(seq))
    return encoder_workload(name)


def wrong_length(plan: str, arch: str = "zoo:gpt_seq7", length: int = 6) -> str:
    """Run on every rank: compile `arch` at its own length, step it on `length` tokens: the
    error's text."""
    import threefold
    torch.set_num_threads(1)
    w = workload(arch)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    try:
        pm.step(w["inputs"][0][:, :length], target=w["target"][:, :length])
    except Exception as exc:   # what the user sees
        return f"{type(exc).__name__}: {exc}"
    return "no error"
