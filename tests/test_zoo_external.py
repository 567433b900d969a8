"""Other projects' models, used as is from their PyPI packages (tests/zoo/external.py), under
the zoo's plan families plus cp=2 and, for the MoEs, dp=2,ep=2.

The packages are the `zoo` extra (pip install -e '.[zoo]'); without them every test here
skips with a one-line reason. The single-process checks run in the default tier; the parity
cells are marked `zoo` (python -m pytest -m zoo tests/test_zoo_external.py). EXPECTED holds
each cell's verdict as measured (tests/zoo/MATRIX.md, "Other projects' models"): a refusal
must stay a one-line PlanError naming its cause.
"""
import re

import pytest
import torch

from tests.zoo.external import FACTORIES, MOE, missing_reason
from tests.zoo.matrix import PLANS

ARCHS = list(FACTORIES)
EXTRA_PLANS = ["cp=2"]
EP_PLANS = ["dp=2,ep=2"]
CELLS = [(a, p) for a in ARCHS for p in PLANS + EXTRA_PLANS] + [(a, p) for a in MOE for p in EP_PLANS]

# (arch, plan) -> regex of the expected PlanError, as measured; every other cell must pass.
_UNTRACEABLE = r"cannot trace _MoELM: torch\.export rejected data-dependent control flow .*one_hot"
EXPECTED_PLANERROR: dict[tuple[str, str], str] = {
    # F.one_hot(idx, max(idx.max() + 1, capacity)): a class count read from the data
    **{(a, p): _UNTRACEABLE for a in ("st_moe", "sgmoe") for p in PLANS + EXTRA_PLANS + EP_PLANS},
    # x[:, :-1] inside the wrapper: a shift along the sequence (x-transformers' and PaLM's rotary
    # tables from a float arange(n) and einsum attention pass cp=2 since issue 40's second round;
    # soft-moe's slot dispatch softmaxes over every token: the all-gather fallback)
    ("xt_autoregressive", "cp=2"): r"cp=2: slice at <top> slices along the sequence",
}


def _skip_if_missing(arch):
    reason = missing_reason(arch)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("arch", ARCHS)
def test_external_factory_is_deterministic_tiny_and_trains(arch):
    """Two builds give identical weights, inputs and losses; the model stays tiny; SGD lowers the loss."""
    _skip_if_missing(arch)
    from tests.parity import sgd_losses
    a, b = FACTORIES[arch](), FACTORIES[arch]()
    for (n, p), (_, q) in zip(a["model"].named_parameters(), b["model"].named_parameters()):
        assert torch.equal(p, q), (arch, n)
    assert all(torch.equal(x, y) for x, y in zip(a["inputs"], b["inputs"]))
    assert sum(p.numel() for p in a["model"].parameters()) < 100_000, arch
    losses = sgd_losses(a, 3, 0.1, torch.optim.SGD)
    assert losses == sgd_losses(b, 3, 0.1, torch.optim.SGD)
    assert losses[-1] < losses[0], losses


def test_missing_package_is_a_one_line_skip_reason(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "palm_pytorch", None)   # import of it now raises ImportError
    reason = missing_reason("palm")
    assert reason and "\n" not in reason and "PaLM-pytorch" in reason and "[zoo]" in reason
    assert missing_reason("llama") is None


_cache: dict = {}


def _cells() -> dict:
    if "cells" not in _cache:
        from tests.zoo.matrix import run_matrix
        archs = [a for a in ARCHS if not missing_reason(a)]
        plans = PLANS + EXTRA_PLANS + EP_PLANS
        only = {(a, p) for a, p in CELLS if a in archs}
        _cache["cells"] = run_matrix(archs, plans, log=lambda s: None, only=only)["cells"]
    return _cache["cells"]


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("arch,plan", CELLS)
def test_external_model_matches_single_process(arch, plan, request):
    expr = request.config.option.markexpr or ""
    if "zoo" not in expr or "not zoo" in expr:
        pytest.skip("the external-model matrix runs only when selected with -m zoo")
    _skip_if_missing(arch)
    verdict = _cells()[(arch, plan)]
    if (arch, plan) in EXPECTED_PLANERROR:
        assert verdict["verdict"] == "planerror", verdict
        assert re.search(EXPECTED_PLANERROR[(arch, plan)], verdict["msg"]), verdict["msg"]
    else:
        assert verdict["verdict"] == "pass", verdict
