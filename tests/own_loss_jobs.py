"""Models that return their own loss (no loss_fn), and the jobs their parity tests launch.

`own_gpt`: the example GPT returning (logits, masked mean cross-entropy) from (idx, labels),
with some labels ignored (-100) so microbatches hold different numbers of counted tokens:
only a numerator/denominator combination from the loss graph gives the one-process loss.
`hf_labels(arch)`: a tiny Hugging Face causal LM called with labels=, returning its whole
ModelOutput (the loss is `.loss`, computed by the model's own loss function).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from threefold.model_loss import model_loss


class OwnLoss(torch.nn.Module):
    """(logits, loss): the loss computed in forward from labels given as an input."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, labels):
        logits = self.model(idx)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


class WithLabels(torch.nn.Module):
    """A Hugging Face causal LM called as users do: model(input_ids=..., labels=...)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False)


def _masked(labels: torch.Tensor) -> torch.Tensor:
    labels = labels.clone()
    labels[0, 3:] = -100     # the first row counts 3 tokens, the others all of theirs
    labels[-1, :2] = -100
    return labels


def own_gpt(seed: int = 0) -> dict:
    from tests.parity import load_workload
    w = load_workload("gpt", n_layer=2, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=4, seed=seed)
    return {"model": OwnLoss(w["model"]), "inputs": (w["inputs"][0], _masked(w["target"]))}


def hf_labels(arch: str, seed: int = 0) -> dict:
    from tests.zoo.hf_decoders import decoder
    w = decoder(arch, seed)
    ids = w["inputs"][0]
    return {"model": WithLabels(w["model"].model), "inputs": (ids, _masked(ids))}


WORKLOADS = {"own_gpt": own_gpt, "llama": lambda: hf_labels("llama"), "mixtral": lambda: hf_labels("mixtral")}


def reference(name: str, steps: int, lr: float = 0.1) -> list[tuple[float, float]]:
    """One process: (loss, gradient norm) of each of `steps` SGD steps, loss from the model."""
    torch.manual_seed(1234)
    w = WORKLOADS[name]()
    model = w["model"]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model_loss(model(*w["inputs"]))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        opt.step()
        out.append((loss.item(), float(norm)))
    return out


def parallel(cases: list[tuple[str, str]], steps: int, lr: float = 0.1) -> list:
    """On every rank: each (workload, plan) trained `steps` SGD steps without a loss_fn;
    (loss, gradient norm) per step, or the PlanError's text."""
    import threefold
    torch.set_num_threads(1)
    results = []
    for name, plan in cases:
        torch.manual_seed(1234)
        w = WORKLOADS[name]()
        try:
            pm = threefold.parallelize(w["model"], plan, w["inputs"])
        except threefold.PlanError as exc:
            results.append(f"PlanError: {exc}")
            continue
        opt = pm.optimizer(torch.optim.SGD, lr=lr)
        got = []
        for _ in range(steps):
            opt.zero_grad()
            loss = pm.step(*w["inputs"])
            norm = pm.clip_grad_norm_(math.inf)
            opt.step()
            got.append((loss, float(norm)))
        results.append(got)
    return results
