import os
import sys

import pytest
import torch

torch.set_num_threads(1)

# Fails any test that leaves sys.path changed (tests/sys_path_guard.py).
pytest_plugins = ["tests.sys_path_guard", "pytester"]


def pytest_report_header(config):
    """The versions this run tested (CI's constraints or the newest releases), so a failure
    caused by a registry release names the release."""
    from importlib import metadata
    found = []
    for dist in ("torch", "transformers", "triton", "safetensors", "tokenizers", "huggingface_hub"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            found.append(f"{dist} absent")
    return "threefold tested against: " + ", ".join(found)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    from tests.tiers import in_default_sample, is_long_single_process, unmatched
    # The longest single-process tests are `slow` too (out of the quick tier, in the default
    # run); multi-rank tests outside the default run's sample are `extended` (tests/tiers.py).
    for item in items:
        if is_long_single_process(item.nodeid):
            item.add_marker(pytest.mark.slow)
        # markers, not keywords: keywords hold the names of parent folders too (a checkout
        # in a folder named "zoo" would otherwise move every test out of the tiers)
        if (item.get_closest_marker("slow") and not item.get_closest_marker("zoo")
                and not in_default_sample(item.nodeid)):
            item.add_marker(pytest.mark.extended)
    # (only when whole files were collected: naming single tests collects part of a file)
    missing = [] if any("::" in a for a in config.args) else unmatched([item.nodeid for item in items])
    if missing and not config.option.deselect:
        raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {missing}; fix the sample")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# THREEFOLD_TEST_TIMES=FILE appends one line per test: wall seconds and CPU seconds of the
# test process and the ranks it spawned (reaped children). CPU time hardly moves with the
# machine's load, so it is what the tiers are sized by (README "Test tiers").
_TIMES = os.environ.get("THREEFOLD_TEST_TIMES")
if _TIMES:
    import resource
    import time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        def cpu() -> float:
            s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
        wall0, cpu0 = time.monotonic(), cpu()
        yield
        with open(_TIMES, "a") as f:
            f.write(f"{time.monotonic() - wall0:.1f}\t{cpu() - cpu0:.1f}\t{item.nodeid}\n")
