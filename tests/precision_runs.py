"""Helpers for mixed-precision and ZeRO-1 tests: the same steps single-process and on ranks."""
from __future__ import annotations

import torch

from tests.parity import load_workload

OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1}),
              "momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})}


def reference(factory: str, kwargs: dict, steps: int, optimizer: str, dtype=None) -> list[float]:
    """Single process: `steps` steps of the workload, its forward under torch.autocast(dtype)
    when dtype is given (fp32 parameters and optimizer, as under plan dtype=bf16)."""
    w = load_workload(factory, **kwargs)
    model = w["model"]
    cls, opts = OPTIMIZERS[optimizer]
    opt = cls([p for p in model.parameters() if p.requires_grad], **opts)
    # fp16: torch's own dynamic loss scaling, with the defaults our LossScaler shares
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append(loss.item())
    return out


def parallel(plans: list[str], factory: str, kwargs: dict, steps: int, optimizer: str) -> list[dict]:
    """On every rank of a launched job: each plan in turn, trained with pm.optimizer(...)."""
    import threefold
    from threefold.runtime.zero import held_bytes
    torch.set_num_threads(1)
    results = []
    cls, opts = OPTIMIZERS[optimizer]
    for plan in plans:
        w = load_workload(factory, **kwargs)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        opt = pm.optimizer(cls, **opts)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            losses.append(pm.step(*w["inputs"], target=w["target"]))
            opt.step()
        results.append({"plan": plan, "losses": losses, "bytes": held_bytes(pm.engine, opt)})
    return results


def rounding_noise(factory: str, kwargs: dict, steps: int, optimizer: str, dtype, draws: int = 8,
                   rel: float = 2.0 ** -8) -> list[float]:
    """The standard deviation, per step, of a 16-bit run's rounding error on this model.

    Each draw multiplies every weight by (1 + rel*U(-1,1)) (rel = the format's unit roundoff:
    2^-8 for bf16, 2^-11 for fp16; so
    each value lands somewhere new inside its 16-bit rounding interval and every rounding
    downstream is re-drawn), then trains the perturbed model twice, under autocast(dtype)
    and in fp32; the difference of their losses is that draw's rounding error (the fp32
    run removes what the perturbation itself changes). Two correct 16-bit computations of
    the same model, such as the parallel run and the single-process one, are two such
    draws: their difference has standard deviation sqrt(2) * sigma."""
    import statistics
    errors = []
    for k in range(draws):
        runs = []
        for dt in (dtype, None):
            w = load_workload(factory, **kwargs)
            g = torch.Generator().manual_seed(1000 + k)
            with torch.no_grad():
                for p in w["model"].parameters():
                    p.mul_(1 + rel * (2 * torch.rand(p.shape, generator=g) - 1))
            runs.append(_train(w, steps, optimizer, dt))
        errors.append([a - b for a, b in zip(*runs)])
    return [statistics.pstdev(col) for col in zip(*errors)]


def _train(w: dict, steps: int, optimizer: str, dtype) -> list[float]:
    model = w["model"]
    cls, opts = OPTIMIZERS[optimizer]
    opt = cls([p for p in model.parameters() if p.requires_grad], **opts)
    out = []
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append(loss.item())
    return out
