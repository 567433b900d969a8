"""Helpers for parity tests: the same SGD steps single-process and on local gloo ranks."""
from __future__ import annotations

import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_workload(factory: str, **kwargs):
    """factory: 'gpt', 'gpt2' or 'llama' (examples/), with keyword sizes."""
    if factory == "gpt":
        from examples.gpt import workload
        return workload(**kwargs)
    from examples import hf
    return getattr(hf, factory)(**kwargs)


def sgd_losses(w: dict, steps: int, lr: float = 0.1, optimizer=torch.optim.SGD) -> list[float]:
    """The single-process reference: `steps` steps of workload `w` with `optimizer` (SGD by
    default; trainable parameters only), the loss before each update."""
    model = w["model"]
    opt = optimizer([p for p in model.parameters() if p.requires_grad], lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def sgd_losses_and_grads(w: dict, steps: int, lr: float = 0.1) -> tuple[list[float], list[dict]]:
    """The single-process reference with its gradients: per SGD step, the loss and each
    parameter's gradient before the update."""
    model = w["model"]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        losses.append(loss.item())
        grads.append({f: p.grad.clone() for f, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return losses, grads


def parallel_sgd_losses(pm, w: dict, steps: int, lr: float = 0.1) -> list[float]:
    """`steps` SGD steps of ParallelModule `pm` on workload `w`'s batch: the loss of each.
    The optimizer is the one the plan needs (pm.optimizer: plain SGD, or its ZeRO-1 form)."""
    opt = pm.optimizer(torch.optim.SGD, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.step(*w["inputs"], target=w["target"]))
        opt.step()
    return losses


def adamw_losses(w: dict, steps: int, lr: float) -> list[float]:
    """The single-process reference under AdamW (torch's defaults but the learning rate)."""
    return sgd_losses(w, steps, lr, torch.optim.AdamW)


def reference_losses(factory: str, kwargs: dict, steps: int, lr: float = 0.1) -> list[float]:
    return sgd_losses(load_workload(factory, **kwargs), steps, lr)


def parallel_losses(plans: list[str], factory: str, kwargs: dict, steps: int, lr: float = 0.1):
    """Run on every rank of a launched job: each plan in turn (same world size)."""
    import threefold
    torch.set_num_threads(1)
    results = []
    for plan in plans:
        w = load_workload(factory, **kwargs)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        losses = parallel_sgd_losses(pm, w, steps, lr)
        results.append({"plan": plan, "losses": losses, "peak_inflight": pm.stats.peak_inflight})
    return results


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def ep_checkpoint_round_trip(make_workload, directory: str) -> list[float]:
    """Run on every rank: 2 AdamW steps at dp=2,ep=2, saved; loaded at dp=2 (no ep) and at
    dp=2,ep=2 again, each then taking steps 3 (the weights) and 4 (AdamW's moments read from
    the checkpoint too). The 4 losses of both loads must be the single process's steps 3-4."""
    import threefold
    torch.set_num_threads(1)
    out = []
    for plan, action in (("dp=2,ep=2", "save"), ("dp=2", "load"), ("dp=2,ep=2", "load")):
        torch.manual_seed(1234)
        w = make_workload()
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
        if action == "save":
            for _ in range(2):
                opt.zero_grad()
                pm.step(*w["inputs"], target=w["target"])
                opt.step()
            threefold.save(pm, opt, directory, step=2)
            continue
        threefold.load(pm, opt, directory)
        for _ in range(2):
            opt.zero_grad()
            out.append(pm.step(*w["inputs"], target=w["target"]))
            opt.step()
    return out
