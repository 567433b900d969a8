"""Progress of a command's long phases on stderr: tracing, the compiler's passes, costing.

`check`, `inspect`, `plan SPEC` and `train`'s parent compile print nothing else for tens of
seconds on a big model. On a terminal one rich status line follows each stage (it clears
itself, so an error stays the one line it is); elsewhere stderr stays quiet unless
THREEFOLD_PROGRESS=1 asks for one plain line per phase (`threefold check: compiling: trace
(torch.export)... [0.0 s]`). `--json` keeps stderr quiet (enabled=False).
"""
from __future__ import annotations

import os
import sys
import time

_LABELS = {"trace": "trace (torch.export)"}


class Phases:
    """Context manager and `progress(stage)` callback (compile_workload's)."""

    def __init__(self, command: str, enabled: bool = True, what: str = "compiling"):
        self.command, self.enabled, self.what = command, enabled, what
        self._status = None
        self._start = self._phase_start = time.perf_counter()
        self._phase = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._start = time.perf_counter()
        try:
            from rich.console import Console   # lazy: rich loads only for the progress display
            console = Console(stderr=True)
            if console.is_terminal:
                self._status = console.status(f"{self.what}")
                self._status.__enter__()
        except ImportError:
            pass
        if self._status is None and os.environ.get("THREEFOLD_PROGRESS") != "1":
            self.enabled = False    # not a terminal: scripts and logs get only results and errors
        return self

    def __call__(self, stage: str) -> None:
        if not self.enabled:
            return
        label = _LABELS.get(stage, stage)
        if self._status is not None:
            self._status.update(f"{self.what}: {label} ({time.perf_counter() - self._start:.0f} s)")
            return
        # plain lines: a line per named phase; the compiler's passes (one-word names after
        # the trace) as one phase, each pass being short
        phase = "passes" if self._phase in ("trace", "passes") and stage.isidentifier() else stage
        if phase != self._phase:
            self._line(f"{label if phase != 'passes' else 'compiler passes'}...")
            self._phase = phase

    def _line(self, text: str) -> None:
        print(f"threefold {self.command}: {self.what}: {text} [{time.perf_counter() - self._start:.1f} s]",
              file=sys.stderr, flush=True)

    def __exit__(self, exc_type, *rest):
        if not self.enabled:
            return False
        if self._status is not None:
            self._status.__exit__(exc_type, *rest)
        elif exc_type is None:
            self._line("done")
        return False
