"""Record what a rank ran during chosen training steps: every schedule action, transfer,
collective and wait, with start and end times (`threefold train --trace`, `run --trace`,
THREEFOLD_TRACE=DIR for `parallelize`).

Nothing here runs unless a step is traced. The engine's dispatch reads the clock only when
its `tracer` is set (it then runs its handlers through `Recorder.wrap`), and runtime/comm.py's
collectives and waits report to a recorder only while one is installed (`comm._recorders`);
otherwise neither reads a clock. While tracing, every record costs a few hundred
nanoseconds, which `Recorder.calibrate` measures so the trace can say what it added.

Each event is (stream, name, category, start ns, end ns, args) in this rank's
`time.perf_counter_ns` clock; runtime/trace_merge.py aligns the ranks' clocks and writes
the Chrome trace-event file, runtime/trace_stats.py reads the bubble out of it.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime import comm
from threefold.runtime.schedule import Action, Kind
from threefold.runtime.trace_merge import STREAMS, clock, merge

STEP, COMPUTE, SEND, RECV, COLLECTIVES = range(len(STREAMS))   # indices into STREAMS

# Where an action's event goes: F/B/W on compute, sends on send; every other action (the
# schedule's collectives: gradient reduce, unshard, loss, tied and sp sums) on collectives.
_STREAM_OF = {Kind.FORWARD: (COMPUTE, "compute"), Kind.BACKWARD: (COMPUTE, "compute"),
              Kind.WEIGHT: (COMPUTE, "compute"), Kind.SEND_ACT: (SEND, "send"), Kind.SEND_GRAD: (SEND, "send")}


class Recorder:
    """The events of one rank's traced steps."""

    def __init__(self, rank: int, actions: list):
        self.rank = rank
        self.events: list[tuple] = []
        self.step = 0                                  # the step being recorded (1-based)
        self.position = {str(a): i for i, a in enumerate(actions)}   # action -> index in the list
        self.event_ns = 0.0                            # measured cost of one record
        self._groups: dict[int, list[int]] = {}

    # -- the primitive ---------------------------------------------------------------------
    def add(self, stream: int, name: str, cat: str, t0: int, t1: int, **args) -> None:
        args["step"] = self.step
        self.events.append((stream, name, cat, t0, t1, args))

    @contextlib.contextmanager
    def span(self, stream: int, name: str, cat: str, **args):
        t0 = clock()
        try:
            yield
        finally:
            self.add(stream, name, cat, t0, clock(), **args)

    # -- the engine's actions --------------------------------------------------------------
    def wrap(self, handlers: dict, post, land):
        """The engine's action handlers, its receive post and its receive landing, each
        timed as one event named by its action (F3.1, sa3.1>2, ...)."""
        def action(kind, fn):
            stream, cat = _STREAM_OF.get(kind, (COLLECTIVES, "collective"))   # ar, rs, ag, ts, ...

            def run(st, a):
                t0 = clock()
                fn(st, a)
                self._action(stream, cat, a, t0, "run")
            return run

        def timed_post(st, a):
            t0 = clock()
            pending = post(st, a)
            self._action(RECV, "recv", a, t0, "post")
            return pending

        def timed_land(st, a, pending):
            t0 = clock()
            land(st, a, pending)
            self._action(RECV, "wait", a, t0, "land")

        return {k: action(k, fn) for k, fn in handlers.items()}, timed_post, timed_land

    def _action(self, stream: int, cat: str, a, t0: int, phase: str) -> None:
        name = str(a) if phase != "post" else f"post {a}"
        self.add(stream, name, cat, t0, clock(), action=str(a), kind=a.kind.value, chunk=a.chunk,
                 mb=a.mb, phase=phase, index=self.position.get(str(a), -1))

    # -- runtime/comm.py's collectives and waits -------------------------------------------
    def comm_call(self, fn, args: tuple, kwargs: dict):
        """Run one of comm's recorded functions (all_reduce, all_gather, wait, a send's
        wait) and record it: what it moved, over which ranks, and for how long this rank's
        thread was inside it (an async collective: only its posting)."""
        code = fn.__code__      # the arguments by name, without inspect's (slower) binding
        bound = dict(zip(code.co_varnames[:code.co_argcount], args), **kwargs)
        t0 = clock()
        result = fn(*args, **kwargs)
        t1 = clock()
        what = bound.get("what") or getattr(bound.get("self"), "what", "")
        name = fn.__name__
        if name == "wait":
            if "self" in bound:   # PendingSend.wait: the sends of this step finishing
                self.add(SEND, f"send wait: {what}", "wait", t0, t1, peer=bound["self"].peer)
            else:
                self.add(COLLECTIVES, f"wait: {what}", "wait", t0, t1)
            return result
        tensor = bound.get("t")
        info = {"ranks": self._ranks(bound.get("group")),
                "bytes": int(tensor.numel() * tensor.element_size()) if tensor is not None else 0}
        posted = bool(bound.get("async_op"))
        label = name.replace("_", "-") + (" (posted)" if posted else "")
        self.add(COLLECTIVES, f"{label}: {what}", "collective", t0, t1, **info)
        return result

    def _ranks(self, group) -> list[int]:
        key = id(group)
        if key not in self._groups:
            try:
                self._groups[key] = sorted(dist.get_process_group_ranks(group if group is not None
                                                                        else dist.group.WORLD))
            except Exception:
                self._groups[key] = []
        return self._groups[key]

    # -- what tracing costs ----------------------------------------------------------------
    def calibrate(self, n: int = 200, rounds: int = 15) -> float:
        """Nanoseconds one record costs, measured here on the path an action takes (two clock
        reads, naming the action, an append)."""
        a = Action(Kind.FORWARD, 0, 0)
        scratch, best = Recorder(self.rank, [a]), float("inf")
        for _ in range(rounds):   # the quickest of many short rounds: a busy host preempts some
            t0 = clock()
            for _ in range(n):
                scratch._action(COMPUTE, "compute", a, clock(), "run")
            best = min(best, (clock() - t0) / n)
        self.event_ns = best
        return best


class StepTracer:
    """Traces the chosen steps (1-based numbers) of one rank's engine. `step(n)` is a
    context around everything step n does (the engine's step, and for the train loop the
    clipping and the optimizer); `span(...)` times a part of it; `finish()` (collective:
    every rank calls it) aligns clocks and returns the merged Chrome trace on rank 0."""

    def __init__(self, engine, steps, meta: dict | None = None):
        self.engine = engine
        self.steps = sorted(set(int(s) for s in steps))
        self.recorder = Recorder(engine.groups.rank, engine.schedule.actions[engine.stage])
        self.meta = dict(meta or {})
        self.active = False
        self.traced: list[int] = []
        self.step_ns: list[int] = []            # wall time of each traced step on this rank

    @property
    def done(self) -> bool:
        return bool(self.steps) and self.steps[-1] in self.traced

    @contextlib.contextmanager
    def step(self, number: int):
        if number not in self.steps or number in self.traced:
            yield
            return
        rec = self.recorder
        if not rec.event_ns:
            rec.calibrate()
        rec.step = number
        comm._recorders.append(rec)
        self.active = True
        t0 = clock()
        try:
            with self.engine.traced(rec):
                yield
        finally:
            t1 = clock()
            self.active = False
            comm._recorders.remove(rec)
            rec.add(STEP, f"step {number}", "step", t0, t1)
            self.traced.append(number)
            self.step_ns.append(t1 - t0)

    def span(self, name: str, cat: str = "optimizer"):
        """A part of a traced step outside the engine (clipping, the optimizer); a no-op
        (no clock read) in a step that is not traced."""
        if not self.active:
            return contextlib.nullcontext()
        return self.recorder.span(COMPUTE, name, cat)

    def finish(self) -> dict | None:
        """Collective: the merged trace (trace_merge.chrome_trace) on rank 0, None elsewhere."""
        rec = self.recorder
        own = {"rank": rec.rank, "events": rec.events, "event_ns": rec.event_ns,
               "step_ns": self.step_ns,
               "coord": {axis: getattr(self.engine.coord, axis) for axis in ("pp", "dp", "tp")}}
        meta = {**self.meta, "plan": str(self.engine.manifest.plan), "steps": self.traced,
                "schedule": self.engine.schedule.to_json(),
                "mesh": {"tp": self.engine.mesh.tp, "dp": self.engine.mesh.dp, "pp": self.engine.mesh.pp}}
        return merge(own, meta, self.engine.device)


class NoTracer:
    """What a run without --trace uses: every method a no-op, no clock reads."""
    steps: list = []
    done = False

    def step(self, number: int):
        return contextlib.nullcontext()

    def span(self, name: str, cat: str = "optimizer"):
        return contextlib.nullcontext()

    def finish(self):
        return None


def parse_steps(text: str, flag: str = "--trace-steps") -> list[int]:
    """'3' or '3,5,7' -> [3, 5, 7]; a PlanError for anything else."""
    try:
        steps = sorted({int(part) for part in str(text).split(",") if part.strip()})
    except ValueError:
        steps = []
    if not steps or steps[0] < 1:
        raise PlanError(f"{flag} {text!r} is invalid: give step numbers from 1, e.g. 3 or 3,5,7")
    return steps


class EnvTrace:
    """THREEFOLD_TRACE=DIR for `parallelize`: the chosen `pm.step` calls (THREEFOLD_TRACE_STEPS,
    default 3: the third call) are traced, and after the last one rank 0 writes DIR/trace.json
    and DIR/trace.html (the user's optimizer runs outside pm.step, so it is not in them).
    `write(out, trace)` writes them: the front end's (the runtime draws no pages)."""

    def __init__(self, engine, out: str, steps: list[int], write):
        self.out = out
        self.write = write
        self.tracer = StepTracer(engine, steps, {"workload": "parallelize"})
        self.calls = 0

    @classmethod
    def from_env(cls, engine, write) -> "EnvTrace | None":
        out = os.environ.get("THREEFOLD_TRACE")
        if not out:
            return None
        return cls(engine, out, parse_steps(os.environ.get("THREEFOLD_TRACE_STEPS", "3"), "THREEFOLD_TRACE_STEPS"),
                   write)

    def run(self, step):
        """Run one pm.step (`step()`), traced when it is a chosen one."""
        self.calls += 1
        if self.tracer.done or self.calls not in self.tracer.steps:
            return step()
        with self.tracer.step(self.calls):
            loss = step()
        if self.tracer.done:
            self._write(self.tracer.finish())
        return loss

    def _write(self, trace: dict | None) -> None:
        if trace is not None:      # rank 0
            self.write(self.out, trace)
