"""The progress bar of `threefold train` (rank 0 only): a "compiling" phase until the first
step starts, then steps, loss, the last validation loss and tokens/s. The tokens/s shown is
`metrics.tokens_per_second` over the steps so far, the figure the summary prints at the end."""
from __future__ import annotations

import contextlib
import math


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        if enabled:
            # lazy: rich loads only for the progress display
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self.bar = Bar(TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[val]}"),
                           TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeElapsedColumn(),
                           TimeRemainingColumn())
            self.task = self.bar.add_task("compiling", total=total, loss=math.nan, val="", tps=0.0)

    def __enter__(self):
        if self.enabled:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)

    def training(self, done: int) -> None:
        """Compilation is over; `done` steps were already done (a resumed run)."""
        if self.enabled:
            self.bar.reset(self.task, completed=done, description="train")

    def update(self, loss: float, tokens_per_s: float, val_loss: float | None = None) -> None:
        if self.enabled:
            fields = {"loss": loss, "tps": tokens_per_s}
            if val_loss is not None:
                fields["val"] = f"val {val_loss:.4f}"
            self.bar.update(self.task, advance=1, **fields)


@contextlib.contextmanager
def compiling_status(text: str, enabled: bool):
    """A spinner on stderr while the parent process compiles the plan once to check it."""
    if not enabled:
        yield
        return
    from rich.console import Console   # lazy: rich loads only for the progress display
    with Console(stderr=True).status(text):
        yield
