"""A pytest plugin: no test changes sys.path for the tests after it.

sys.path is recorded as the session found it once pytest had set it up (pyproject's
`pythonpath` puts the repository root first, so `tests.*`, `examples.*` and `threefold` import
from this checkout) and again when collection finishes. A folder of ours left on the path lets
a module of ours shadow an installed package: bench/kernels.py once hid the `kernels` package
that transformers imports, and 45 tests failed.
"""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYS_PATH_AT_START = tuple(sys.path)
SYS_PATH_AFTER_COLLECTION: list[tuple[str, ...]] = []


def changes(before, after) -> tuple[list[str], list[str]]:
    """(folders of this repository added, entries removed) between two sys.path values.
    Installed libraries may add their own folders as they import (setuptools adds its
    _vendor when Inductor first loads it): those shadow nothing of ours and are let be."""
    def inside(p: str, folder: str) -> bool:
        return p == folder or p.startswith(folder + os.sep)

    def ours(p: str) -> bool:   # (a virtual environment kept in the checkout is not ours)
        full = os.path.abspath(p or os.getcwd())
        return inside(full, ROOT) and not inside(full, os.path.abspath(sys.prefix))
    added = [p for p in after if p not in before and ours(p)]
    removed = [p for p in before if p not in after]
    return added, removed


def pytest_collection_finish(session):
    SYS_PATH_AFTER_COLLECTION.append(tuple(sys.path))


@pytest.fixture(autouse=True)
def _sys_path_untouched():
    """Fail the test that leaves sys.path changed, and put the path back for the next one."""
    before = list(sys.path)
    yield
    added, removed = changes(before, sys.path)
    if added or removed:
        sys.path[:] = before
        pytest.fail(f"the test changed sys.path (added {added}, removed {removed}); "
                    "import by package (tests.x) or by file path instead", pytrace=False)
