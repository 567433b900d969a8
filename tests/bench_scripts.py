"""bench/ scripts as modules for the tests, without leaving bench/ on sys.path.

A bench script imports its siblings by bare name (`from pipeline_overhead import Config`),
which works when it runs as `python bench/x.py`. In the test session those bare names must not
stay importable: one of them could shadow an installed package for every later test (a
bench/kernels.py once hid the `kernels` package that transformers imports).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@contextlib.contextmanager
def bench_on_path():
    """bench/ importable inside the block; afterwards sys.path is as before and the scripts
    imported in the block are gone from sys.modules (their module objects live on where held)."""
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        yield
    finally:
        sys.path[:] = saved
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None) or ""
            if os.path.dirname(os.path.abspath(path)) == BENCH:
                del sys.modules[name]


def load(name: str):
    """Import bench/<name>.py (and the siblings it imports at the top) inside bench_on_path."""
    with bench_on_path():
        return importlib.import_module(name)
