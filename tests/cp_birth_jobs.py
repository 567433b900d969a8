"""Jobs for tests/test_cp_birth.py: ViTs whose sequence is born inside the model, under cp."""
from __future__ import annotations

import torch

from tests.cp_factory_models import parallel, reference


def vit_workload(arch: str) -> dict:
    from tests.zoo import ZOO
    return ZOO[arch]()


def vit_parity(archs: list, plan: str, steps: int = 3) -> dict:
    """Run on every rank: each ViT under `plan`, (losses, grads) over `steps` SGD steps."""
    torch.set_num_threads(1)
    return {a: parallel(vit_workload(a), plan, steps) for a in archs}


def vit_reference(arch: str, steps: int = 3):
    torch.set_num_threads(1)
    return reference(vit_workload(arch), steps)


def vit_parity_or_error(archs: list, plan: str, steps: int = 3) -> dict:
    """vit_parity, with each arch's failure as its one-line text (to tell a refusal in a test)."""
    torch.set_num_threads(1)
    out = {}
    for a in archs:
        try:
            out[a] = parallel(vit_workload(a), plan, steps)
        except Exception as exc:
            out[a] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
    return out
