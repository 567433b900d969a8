"""What `threefold check` compares a dtype=bf16|fp16 plan with, and how closely.

The reference is the single process under `torch.autocast(dtype)` with fp32 parameters
(and torch.amp.GradScaler for fp16), which is what the plan computes. The two runs round
at different places (tp partial sums, summation orders), so they agree only up to the
16-bit rounding noise of the loss, which is measured on the workload itself: each draw
multiplies every weight by (1 + u U(-1,1)), u the format's unit roundoff, and trains the
perturbed model in 16 bits and in fp32; the loss difference is that draw's rounding error.
Its standard deviation per step is sigma_k, the two runs are two such draws, and step k
agrees when |parallel - reference| <= 4 sqrt(2) sigma_k (docs/design.md).
"""
from __future__ import annotations

import math
import statistics

import torch

from threefold.model_loss import workload_loss
from threefold.workload import load_spec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
DRAWS = 6


def _fresh(spec: str, state_file: str):
    saved = torch.load(state_file, weights_only=True)
    w = load_spec(spec)
    w.model.load_state_dict(saved["state"])
    return w, saved


def train(w, inputs, target, steps: int, lr: float, dtype) -> list[float]:
    """Plain SGD steps of `w.model`, forward under autocast(dtype) when dtype is given."""
    device = next(iter(w.model.parameters())).device.type
    opt = torch.optim.SGD([p for p in w.model.parameters() if p.requires_grad], lr=lr)
    scaler = torch.amp.GradScaler(device, enabled=dtype is torch.float16)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = workload_loss(w.model, inputs, target, w.loss_fn)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append(loss.item())
    return out


def autocast_reference(spec: str, state_file: str, dtype: str, steps: int, lr: float):
    """(reference losses, tolerance per step, sigma per step) for a 16-bit plan."""
    w, saved = _fresh(spec, state_file)
    reference = train(w, saved["inputs"], saved["target"], steps, lr, DTYPES[dtype])
    errors = []
    for k in range(DRAWS):
        runs = []
        for dt in (DTYPES[dtype], None):
            w, saved = _fresh(spec, state_file)
            g = torch.Generator().manual_seed(1000 + k)
            with torch.no_grad():
                for p in w.model.parameters():
                    noise = 2 * torch.rand(p.shape, generator=g) - 1
                    p.mul_(1 + UNIT_ROUNDOFF[dtype] * noise.to(p.device, p.dtype))
            runs.append(train(w, saved["inputs"], saved["target"], steps, lr, dt))
        errors.append([a - b for a, b in zip(*runs)])
    sigma = [statistics.pstdev(col) for col in zip(*errors)]
    return reference, [4 * math.sqrt(2) * s for s in sigma], sigma
