"""glibc malloc settings for a rank: memory freed in one microbatch is reused by the next
without new page faults.

PyTorch's CPU tensors come from malloc. glibc returns memory to the kernel eagerly: the top
of the heap is trimmed once more than M_TRIM_THRESHOLD of it is free, and blocks above
M_MMAP_THRESHOLD get their own mmap, unmapped on free. A pipeline step frees and
reallocates the same activation and gradient sizes every microbatch, so each of them comes
back as fresh pages and is faulted in again (zero-bubble schedules keep more alive, so
their heap top moves further: measured 10,000-20,000 minor faults per step on a pp=2 rank
of bench/pipeline_bubbles.py's model, none with these settings; BENCHMARKS.md).

Each rank (runtime/launch.py, the local launcher and torchrun alike) therefore keeps its
freed heap (trimming off) and serves blocks up to 32 MiB, glibc's largest heap-served
size on 64-bit, from the heap. Larger blocks are still mmapped per allocation; the
engine's receive buffers, the largest recurring ones, are pooled instead
(runtime/buffer_pool.py). The cost: a rank's resident memory stays at its step peak
between steps, as a caching allocator's does.

Off with THREEFOLD_MALLOC=default; any MALLOC_*_ setting in the environment (glibc's own
tunables) is the user's choice and is left alone.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1       # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
NO_TRIM = -1                # mallopt(3): "-1 disables trimming completely"

APPLIED: dict[str, int] = {}   # what tune_malloc set in this process (benches and tests read it)

_USER_KNOBS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
               "GLIBC_TUNABLES")


def tune_malloc() -> dict[str, int]:
    """Apply the settings above to this process; returns what was set ({} when nothing was:
    not glibc, turned off, or the user set malloc's own knobs)."""
    if os.environ.get("THREEFOLD_MALLOC", "").lower() == "default":
        return {}
    if any(k in os.environ for k in _USER_KNOBS):
        return {}
    if platform.libc_ver()[0] != "glibc":
        return {}
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = {}
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
        done["mmap_threshold"] = MMAP_THRESHOLD
    if mallopt(M_TRIM_THRESHOLD, NO_TRIM) == 1:
        done["trim_threshold"] = NO_TRIM
    APPLIED.update(done)
    return done
