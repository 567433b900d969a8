"""Checkpoints that do not stop training: stage on the step loop, write in the background.

`AsyncSaver.save(...)` blocks only while it copies this rank's pieces into host memory
(every shard piece and optimizer moment copied, one copy per tensor, into a file in
/dev/shm that outlives a killed process: checkpoint/staging.py; where /dev/shm cannot take
it, `stage` clones them in this process); a background thread then runs the same write as `threefold.save`
(checkpoint/save.write_checkpoint: temporary directory, DCP, per-file CRC32 index, atomic
rename, `latest`, keep), so every guarantee of a blocking save holds: a checkpoint is
published only once complete and verified, and a process killed mid-write leaves the
previous checkpoints intact and only a temporary directory the next save or resume drops;
the staged copy then lets the restart commit the interrupted save (staging.settle), so a
kill mid-write loses at most the checkpoint interval.

The background write's collectives run over a process group of their own (gloo, made once
by every rank together), so they never interleave with the step's collectives on the
default group. One write is in flight at a time: the next save (and `wait`, at the end of
training) first waits for the previous one and raises its error, on every rank.
"""
from __future__ import annotations

import copy
import os
import sys
import threading
import time

import torch

from threefold.checkpoint.layout import Sharded
import torch.distributed as dist
from threefold.runtime.comm import default_timeout


class Staged(Sharded):
    """A host-memory copy of one value's pieces (a `Sharded` or ZeRO `RowsOf`), with the
    write items of the original: DCP writes it exactly as it would have written the live one."""

    def __init__(self, fqn: str, live: Sharded):
        self.full_shape = live.full_shape
        self.dim = live.dim
        self.parts = []
        self._items = live.__create_write_items__(fqn, live)
        self._chunks = live.__create_chunk_list__()
        self._pieces = {tuple(offs): _host_copy(view) for offs, _, view in live.regions()}
        self.local = next(iter(self._pieces.values()), torch.empty(0, dtype=live.dtype))

    def piece_at(self, offsets) -> torch.Tensor:
        return self._pieces[tuple(offsets)]

    def __create_write_items__(self, fqn: str, obj):
        return self._items

    def __create_chunk_list__(self):
        return self._chunks


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def stage(sd: dict) -> dict:
    """A copy of a checkpoint state dict that no later training step changes."""
    out = {}
    for key, value in sd.items():
        if isinstance(value, Sharded):
            out[key] = Staged(key, value)
        elif isinstance(value, torch.Tensor):
            out[key] = _host_copy(value)
        else:          # meta (step, extra: losses, rows, data position), groups, rng state
            out[key] = copy.deepcopy(value)
    return out


SWITCH_S = 0.0005    # while a write runs: the loop's thread waits at most this for the GIL
WRITER_NICE = 10     # the writer thread's niceness: on busy cores the step loop runs first


def _yield_to_the_loop() -> None:
    """Make this (the writer) thread the one that waits when the cores are busy: a lower
    priority for it alone (Linux: a thread id is a process id to setpriority), and a short
    GIL switch interval, so the step loop gets the interpreter back within SWITCH_S of
    asking instead of the default 5 ms, after each of its many short collectives."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):
        pass


class AsyncSaver:
    """Background checkpoint writes for one training run; every rank makes one, together."""

    def __init__(self):
        # lazy: start-up: threefold.checkpoint.collective loads 1 more modules only when this runs
        from threefold.checkpoint.collective import rank_world
        self.world = rank_world()[1]
        self.group = None
        if self.world > 1:     # collective: every rank constructs its saver at the same point

            self.group = dist.new_group(backend="gloo", timeout=default_timeout())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: str | None = None
        self.shm = True          # stage in /dev/shm (checkpoint/staging.py) while it takes them
        self.stage_seconds: list[float] = []     # how long each save held the step loop

    def save(self, pm, optimizer, directory: str, step: int, extra=None, keep: int | None = 3,
             run: dict | None = None) -> float:
        """Stage this rank's state now and write it in the background; returns the seconds
        the caller was held (waiting for the previous write, then copying)."""
        # lazy: start-up: threefold.checkpoint.collective loads 1 more modules only when this runs
        from threefold.checkpoint.collective import rank_world
        # lazy: start-up: threefold.checkpoint.save loads 7 more modules only when this runs
        from threefold.checkpoint.save import _collect, check_keep, index_fields, write_checkpoint
        check_keep(keep)
        started = time.perf_counter()
        self.wait()
        rank = rank_world()[0]
        live = _collect(pm, optimizer, step, extra, rank)
        fields = index_fields(pm, optimizer, step, run)
        sd, snapshot = self._stage(live, fields, directory, step, keep, rank)
        self._thread = threading.Thread(target=self._write, name=f"threefold-ckpt-{step}", daemon=True,
                                        args=(write_checkpoint, sd, fields, directory, step, keep, snapshot))
        self._thread.start()
        held = time.perf_counter() - started
        self.stage_seconds.append(held)
        return held

    def _stage(self, live: dict, fields: dict, directory: str, step: int, keep, rank: int):
        """(the state dict to write, its /dev/shm snapshot or None): staged in /dev/shm where
        it can be (checkpoint/staging.py: a kill mid-write then loses nothing), else in this
        process's memory (a kill mid-write falls back to the previous checkpoint)."""
        # lazy: start-up: threefold.checkpoint.staging loads 1 more modules only when this runs
        from threefold.checkpoint.staging import Snapshot, stage_dir
        where = stage_dir(directory) if self.shm else None
        if where is not None:
            snapshot = Snapshot(where, step, rank, self.world)
            try:
                return snapshot.stage(live, fields, keep), snapshot
            except OSError as exc:      # /dev/shm full or missing: stage in memory from now on
                snapshot.drop()
                self.shm = False
                print(f"threefold: cannot stage checkpoints in {where} ({exc.strerror or exc}); staging them in "
                      "memory (a rank killed mid-write falls back to the previous checkpoint)", file=sys.stderr)
        return stage(live), None

    def _write(self, write, sd, fields, directory, step, keep, snapshot=None) -> None:
        _yield_to_the_loop()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, SWITCH_S))
        try:
            if snapshot is not None:
                try:
                    snapshot.seal()         # complete from here on: a restart can commit it
                except OSError:
                    snapshot.drop()
                    snapshot = None
            self.last_path = write(sd, fields, directory, step, keep, self.group)
            if snapshot is not None:
                snapshot.drop()             # published: the staged copy is not needed
        except BaseException as exc:   # raised on the step loop's thread by wait()
            self._error = exc
            # a failure of another rank (killed mid-write) fails this write too: the snapshot
            # stays for whoever restarts the job (staging.settle commits or removes it); alone,
            # nobody else can have failed, so it is removed now
            if snapshot is not None and self.world == 1:
                snapshot.drop()
        finally:
            sys.setswitchinterval(switch)

    def wait(self) -> str | None:
        """Wait for the write in flight (if any); raise its error. The newest path written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        return self.last_path

    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
