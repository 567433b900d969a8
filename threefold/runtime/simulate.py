"""Run a schedule's per-rank action lists on paper: prove them safe, time them, measure the bubble.

`verify(schedule)` is the proof the executor relies on. It checks, and raises a
`ScheduleError` naming the rank, the action and the reason on the first violation:

  * placement: each action's chunk lives on its rank, peers are the neighbouring chunks'
    stages, microbatch ids are in range; every required action appears exactly once
    (no backward, no gradients in a forward-only schedule);
  * local order: receive before the forward/backward that consumes it, forward before
    its send and before its backward, backward before its gradient send; in zero-bubble
    schedules (zb-h1, zbv) every (chunk, mb) also has exactly one W, after its B, and other
    schedules have none;
  * matching: for every ordered pair of ranks, the messages A sends to B are, in order,
    the messages B receives from A (so the executor needs no tags);
  * no deadlock when every send blocks until its receive is posted (rendezvous; this also
    covers buffered sends);
  * the in-flight activation bound of the schedule kind (see `schedule.inflight_bound`),
    and for zero-bubble schedules the bound on what W keeps
    (`zero_bubble.weight_inflight_bound`);
  * collectives (runtime/collective_plan.py): a gradient reduction after its chunk's last
    backward, the wait after every reduction and backward, tied and sequence-parallel sums
    after the wait, a chunk's unit-0 gather before its first forward and its free after its
    last use; every collective over several stages (a tied sum) is issued by each member in
    the same order as by every other member, and the lists cannot deadlock with those sums
    as blocking rendezvous. (Collectives within a stage are issued by every rank of the stage
    from the same list, so they match by construction.)

`simulate(schedule, durations)` times the lists. Durations: None (forward 1, backward 2,
communication 0; zero-bubble schedules: B 1 and W 1, the paper's T_F = T_B = T_W), a
callable `action -> seconds`, or a dict `chunk -> (fwd, bwd)` or `chunk -> (fwd, b, w)`
from the cost model (a 2-tuple under a split schedule gives B and W half the backward each). By default sends do not wait for their receive (`comm="eager"`); pass
`comm="rendezvous"` to time blocking sends instead.

Two bubble numbers, both averaged over the ranks of one pipeline:
  bubble_fraction = idle / (pp * makespan)     share of the iteration's rank-time spent idle
                    (GPipe/1F1B, equal stages: (p-1)/(m+p-1))
  bubble_ratio    = idle / busy                the paper's measure, bubble over ideal compute
                    (GPipe/1F1B: (p-1)/m; interleaved: (p-1)/(v*m))
Idle is everything that is not forward/backward compute, so communication time counts as bubble.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

from threefold.errors import PlanError
from threefold.runtime.schedule import (CHUNK_COLLECTIVES, COLLECTIVES, COMPUTE, KINDS, RECVS, SENDS, Action,
                                        Kind, Schedule, ScheduleError, inflight_bound)

# None (unit costs), action -> time, or chunk -> (fwd, bwd) / (fwd, b, w).
Durations = Union[None, Callable[[Action], float], Mapping[int, tuple]]


def duration_fn(durations: Durations = None, split: bool = False) -> Callable[[Action], float]:
    """Turn the accepted duration forms into one callable action -> time. `split`: the
    schedule's backward is B + W (zero bubble), so B is the input-gradient half only."""
    if durations is None:
        return _unit_split if split else _unit
    if callable(durations):
        return durations
    if isinstance(durations, Mapping):
        table = {}
        for c, times in durations.items():
            times = tuple(float(t) for t in times)
            if len(times) == 2:   # (fwd, whole backward): B and W take half each when split
                f, b = times
                times = (f, b / 2, b / 2) if split else (f, b, 0.0)
            elif len(times) == 3 and not split:   # (fwd, b, w) under a fused backward
                times = (times[0], times[1] + times[2], 0.0)
            elif len(times) != 3:
                raise PlanError(f"durations for chunk {c} are {times!r}: give (fwd, bwd) or (fwd, b, w)")
            table[int(c)] = times
        column = {Kind.FORWARD: 0, Kind.BACKWARD: 1, Kind.WEIGHT: 2}

        def from_cost_model(a: Action) -> float:
            k = column.get(a.kind)
            if k is None:
                return 0.0
            if a.chunk not in table:
                raise PlanError(f"durations have no entry for chunk {a.chunk}: "
                                "give (fwd, bwd) times for every chunk 0..pp*v-1")
            return table[a.chunk][k]
        return from_cost_model
    raise PlanError(f"durations={durations!r} is invalid: pass None, a callable(action) -> time, "
                    "or a dict chunk -> (fwd, bwd)")


def _unit(a: Action) -> int:
    return 1 if a.kind is Kind.FORWARD else 2 if a.kind is Kind.BACKWARD else 0


def _unit_split(a: Action) -> int:
    """The paper's T_F = T_B = T_W = 1 (zero-bubble schedules)."""
    return 1 if a.kind in COMPUTE else 0


@dataclass(frozen=True)
class Simulation:
    schedule: Schedule
    start: list[list[float]]    # start[rank][i]: when actions[rank][i] began (a receive: when posted)
    end: list[list[float]]      # end[rank][i]: when it finished (a receive: when the data arrived)
    makespan: float             # the last action's end; all ranks start at 0
    busy: list[float]           # forward+backward time per rank
    max_inflight: list[int]     # peak activations held per rank, counted per (chunk, mb)
    comm: str                   # "eager" or "rendezvous" sends
    # zero-bubble schedules: peak (chunk, mb) per rank whose F ran and whose W has not
    max_weight_inflight: list[int] | None = None

    @property
    def idle(self) -> float:
        return sum(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        total = self.makespan * self.schedule.pp
        return self.idle / total if total else 0.0

    @property
    def bubble_ratio(self) -> float:
        busy = sum(self.busy)
        return self.idle / busy if busy else 0.0


def simulate(schedule: Schedule, durations: Durations = None, *, comm: str = "eager") -> Simulation:
    """Time every rank's list; ScheduleError if it cannot finish."""
    if comm not in ("eager", "rendezvous"):
        raise PlanError(f"comm={comm!r} is unknown: use eager or rendezvous")
    dur = duration_fn(durations, schedule.splits_backward)
    start, end = _run(schedule, dur, rendezvous=comm == "rendezvous")
    busy = [sum(dur(a) for a in acts if a.kind in COMPUTE) for acts in schedule.actions]
    makespan = max((e[-1] for e in end if e), default=0)
    weights = peak_inflight(schedule, Kind.WEIGHT) if schedule.splits_backward else None
    return Simulation(schedule, start, end, makespan, busy, peak_inflight(schedule), comm, weights)


def peak_inflight(schedule: Schedule, until: Kind = Kind.BACKWARD) -> list[int]:
    """Per rank, the most (chunk, mb) whose forward ran and whose backward (or, with
    until=WEIGHT, whose weight-gradient step) has not.

    Order-only, so it holds for any timing. A forward-only schedule keeps nothing for a
    backward pass, so it reports 0.
    """
    if not schedule.has_backward:
        return [0] * schedule.pp
    peaks = []
    for acts in schedule.actions:
        held = peak = 0
        for a in acts:
            if a.kind is Kind.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.kind is until:
                held -= 1
        peaks.append(peak)
    return peaks


def _cross_stage_members(schedule: Schedule) -> dict[Action, set[int]]:
    """Each tied sum -> the ranks (stages) whose lists hold it."""
    out: dict[Action, set[int]] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind is Kind.TIED_SUM:
                out.setdefault(a, set()).add(r)
    return out


def _run(schedule: Schedule, dur: Callable[[Action], float], rendezvous: bool):
    """Execute all lists, each rank in order; returns per-action start and end times."""
    lists = schedule.actions
    pp = len(lists)
    start = [[0] * len(acts) for acts in lists]
    end = [[0] * len(acts) for acts in lists]
    pos, clock = [0] * pp, [0] * pp
    arrived: dict[tuple, float] = {}      # eager: message -> time the send finished
    comm_free = [0.0] * pp                # each rank's collective stream (async collectives)
    members = _cross_stage_members(schedule)
    at_sum: dict[Action, dict[int, float]] = {}   # a tied sum -> member rank -> arrival time
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            acts, k, t = lists[r], pos[r], clock[r]
            n = len(acts)
            while k < n:
                a = acts[k]
                kind = a.kind
                if kind in COMPUTE:
                    start[r][k] = t
                    t += dur(a)
                elif kind in COLLECTIVES:
                    start[r][k] = t
                    if kind is Kind.TIED_SUM:   # blocking, over the stages holding the parameter
                        arrivals = at_sum.setdefault(a, {})
                        arrivals.setdefault(r, t)
                        if set(arrivals) != members[a]:
                            break
                        t = max(arrivals.values()) + dur(a)
                    elif kind is Kind.WAIT_GRADS:
                        t = max(t, comm_free[r])
                    elif kind in (Kind.ALL_REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS, Kind.LOSS):
                        comm_free[r] = max(comm_free[r], t) + dur(a)   # started, runs beside compute
                    elif kind is Kind.UNSHARD:
                        comm_free[r] = max(comm_free[r], t) + dur(a)
                        t = comm_free[r]          # the chunk's first forward needs it
                    else:
                        t += dur(a)
                elif rendezvous:
                    q = a.peer
                    b = lists[q][pos[q]] if 0 <= q < pp and pos[q] < len(lists[q]) else None
                    if b is None or b.peer != r or (b.kind in SENDS) == (kind in SENDS) or b.message != a.message:
                        break
                    # Both are posted: the transfer starts when the later one is.
                    start[r][k], start[q][pos[q]] = t, clock[q]
                    t = max(t, clock[q]) + max(dur(a), dur(b))
                    end[q][pos[q]] = clock[q] = t
                    pos[q] += 1
                elif kind in SENDS:
                    start[r][k] = t
                    t += dur(a)
                    arrived[a.message] = t
                else:
                    when = arrived.get(a.message)
                    if when is None:
                        break
                    start[r][k] = t
                    t = max(t, when) + dur(a)
                end[r][k] = t
                k += 1
            if k != pos[r]:
                pos[r], clock[r], moved = k, t, True
    stuck = [r for r in range(pp) if pos[r] < len(lists[r])]
    if stuck:
        heads = ", ".join(f"rank {r} at {lists[r][pos[r]]}" for r in stuck)
        how = "blocking (rendezvous) sends" if rendezvous else "buffered sends"
        raise ScheduleError(f"schedule {_label(schedule)} deadlocks with {how}: {heads} wait forever; "
                            "reorder the sends and receives so that the ranks cannot wait on each other")
    return start, end


# ---- verification --------------------------------------------------------------------
@dataclass(frozen=True)
class Report:
    schedule: Schedule
    simulation: Simulation          # eager sends, with the given durations
    rendezvous_makespan: float      # the same lists when every send waits for its receive
    inflight_bound: list[int] | None  # the bound proved for this kind, None for unknown kinds

    @property
    def makespan(self) -> float:
        return self.simulation.makespan

    @property
    def bubble_fraction(self) -> float:
        return self.simulation.bubble_fraction

    @property
    def bubble_ratio(self) -> float:
        return self.simulation.bubble_ratio

    @property
    def max_inflight(self) -> list[int]:
        return self.simulation.max_inflight

    @property
    def formula_bubble_ratio(self) -> float:
        """The paper's (p-1)/(v*m) (v=1 for GPipe and 1F1B); matches with equal stages, m >= p.
        Zero bubble (unit costs F = B = W, runtime/zero_bubble.py): ZB-H1 (p-1)/(3m), a third
        of 1F1B's, for m >= p; ZB-V (p-1)/(6m), the ramp only, for m >= 2p."""
        s = self.schedule
        if s.name == "zb-h1":
            return (s.pp - 1) / (3 * s.m)
        if s.name == "zbv":
            return (s.pp - 1) / (6 * s.m)
        return (s.pp - 1) / (s.v * s.m)

    def to_json(self) -> dict:
        s = self.schedule
        return {
            "schedule": s.name, "pp": s.pp, "microbatches": s.m, "interleave": s.v,
            "bubble_fraction": self.bubble_fraction, "bubble_ratio": self.bubble_ratio,
            "formula_bubble_ratio": self.formula_bubble_ratio,
            "makespan": self.makespan, "rendezvous_makespan": self.rendezvous_makespan,
            "max_inflight": list(self.max_inflight), "inflight_bound": self.inflight_bound,
            "max_weight_inflight": self.simulation.max_weight_inflight,
            "definitions": {
                "bubble_fraction": "idle rank-time / (pp * makespan): share of the iteration spent idle",
                "bubble_ratio": "idle time / busy compute time: the paper's bubble, (p-1)/(v*m)",
                "formula_bubble_ratio": "(pp-1)/(interleave*microbatches); zb-h1 (pp-1)/(3*microbatches); "
                                        "zbv (pp-1)/(6*microbatches)",
                "makespan": "simulated iteration time, forward 1 and backward 2 units per chunk unless "
                            "durations were given, sends not waiting for receives",
                "rendezvous_makespan": "the same when every send blocks until its receive is posted",
                "max_inflight": "per pipeline rank, the most (chunk, microbatch) activations held for backward",
                "max_weight_inflight": "zero-bubble schedules: per rank, the most (chunk, microbatch) whose "
                                       "W has not run (what W keeps); null otherwise",
            },
        }


def verify(schedule: Schedule, durations: Durations = None) -> Report:
    """Prove the schedule safe (see the module docstring) and time it; ScheduleError otherwise."""
    _check_placement(schedule)
    _check_matching(schedule)
    _check_collectives(schedule)
    dur = duration_fn(durations, schedule.splits_backward)
    rendezvous_start, rendezvous_end = _run(schedule, dur, rendezvous=True)
    sim = simulate(schedule, dur)
    bound = inflight_bound(schedule) if schedule.name in KINDS else None
    if bound is not None:
        for r, (peak, most) in enumerate(zip(sim.max_inflight, bound)):
            if peak > most:
                acts = schedule.actions[r]
                raise ScheduleError(f"schedule {_label(schedule)}: rank {r} holds {peak} activations "
                                    f"(at most {most} allowed for {schedule.name}); first action {acts[0]}")
    if schedule.splits_backward:
        # lazy: start-up: runtime.zero_bubble loads only on this path
        from threefold.runtime.zero_bubble import weight_inflight_bound
        for r, (peak, most) in enumerate(zip(sim.max_weight_inflight,
                                             weight_inflight_bound(schedule.name, schedule.pp, schedule.m))):
            if peak > most:
                raise ScheduleError(f"schedule {_label(schedule)}: rank {r} keeps {peak} microbatches for "
                                    f"their weight gradients (at most {most} allowed for {schedule.name})")
    rendezvous_makespan = max((e[-1] for e in rendezvous_end if e), default=0)
    return Report(schedule, sim, rendezvous_makespan, bound)


def _label(s: Schedule) -> str:
    return f"{s.name}(pp={s.pp},m={s.m},v={s.v})"


def _fail(s: Schedule, rank: int, action, reason: str) -> ScheduleError:
    return ScheduleError(f"schedule {_label(s)}: rank {rank}, action {action}: {reason}; "
                         "the generator that built it has a bug (or the list was edited by hand)")


def _check_placement(s: Schedule) -> None:
    pp, chunks, m = s.pp, s.num_chunks, s.m
    last = chunks - 1
    if len(s.actions) != pp:
        raise ScheduleError(f"schedule {_label(s)} has {len(s.actions)} rank lists: it needs one per stage ({pp})")
    positions: list[dict[Action, int]] = []
    for r, acts in enumerate(s.actions):
        where: dict[Action, int] = {}
        for i, a in enumerate(acts):
            c = a.chunk
            if a.is_collective:
                if a.kind in CHUNK_COLLECTIVES and not (0 <= c < chunks and s.stage_of(c) == r):
                    raise _fail(s, r, a, f"chunk {c} does not live on rank {r}")
                if a in where:
                    raise _fail(s, r, a, f"appears twice (positions {where[a]} and {i})")
                where[a] = i
                continue
            if not (0 <= c < chunks and s.stage_of(c) == r):
                raise _fail(s, r, a, f"chunk {c} does not live on rank {r}")
            if not 0 <= a.mb < m:
                raise _fail(s, r, a, f"microbatch {a.mb} is outside 0..{m - 1}")
            if a in where:
                raise _fail(s, r, a, f"appears twice (positions {where[a]} and {i})")
            kind = a.kind
            if not s.has_backward and kind in (Kind.BACKWARD, Kind.SEND_GRAD, Kind.RECV_GRAD, Kind.WEIGHT):
                raise _fail(s, r, a, "a forward-only schedule has no backward pass")
            if kind is Kind.WEIGHT and not s.splits_backward:
                raise _fail(s, r, a, f"{s.name} runs a fused backward: it has no separate W actions")
            if kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
                if c == last:
                    raise _fail(s, r, a, "the last chunk has no next chunk to talk to")
                want = s.stage_of(c + 1)
            elif kind in (Kind.RECV_ACT, Kind.SEND_GRAD):
                if c == 0:
                    raise _fail(s, r, a, "the first chunk has no previous chunk to talk to")
                want = s.stage_of(c - 1)
            else:
                want = -1
            if want == r:
                raise _fail(s, r, a, "its neighbouring chunk lives on the same rank: it is handed over "
                                     "locally, without a message")
            if a.peer != want:
                raise _fail(s, r, a, f"its peer must be {'none' if want < 0 else f'stage {want}'}")
            where[a] = i
        positions.append(where)

    def at(r: int, a: Action, user: Action) -> int:
        i = positions[r].get(a)
        if i is None:
            raise _fail(s, r, user, f"{a} is missing from rank {r}")
        return i

    for c in range(chunks):
        r = s.stage_of(c)
        prev = s.stage_of(c - 1) if c > 0 else -1
        nxt = s.stage_of(c + 1) if c < last else -1
        for i in range(m):
            f = Action(Kind.FORWARD, c, i)
            fi = at(r, f, f)
            if prev == r and at(r, Action(Kind.FORWARD, c - 1, i), f) > fi:
                raise _fail(s, r, f, f"runs before F{c - 1}.{i}, whose outputs it reads on this rank")
            if prev not in (-1, r) and at(r, Action(Kind.RECV_ACT, c, i, prev), f) > fi:
                raise _fail(s, r, f, "runs before its input is received")
            if nxt not in (-1, r) and at(r, Action(Kind.SEND_ACT, c, i, nxt), f) < fi:
                raise _fail(s, r, f, "its output is sent before it runs")
            if not s.has_backward:
                continue
            b = Action(Kind.BACKWARD, c, i)
            bi = at(r, b, b)
            if bi < fi:
                raise _fail(s, r, b, f"runs before {f}")
            if nxt == r and at(r, Action(Kind.BACKWARD, c + 1, i), b) > bi:
                raise _fail(s, r, b, f"runs before B{c + 1}.{i}, whose input gradients it reads on this rank")
            if nxt not in (-1, r) and at(r, Action(Kind.RECV_GRAD, c, i, nxt), b) > bi:
                raise _fail(s, r, b, "runs before its output gradient is received")
            if prev not in (-1, r) and at(r, Action(Kind.SEND_GRAD, c, i, prev), b) < bi:
                raise _fail(s, r, b, "its input gradient is sent before it runs")
            if s.splits_backward:
                w = Action(Kind.WEIGHT, c, i)
                if at(r, w, w) < bi:
                    raise _fail(s, r, w, f"runs before {b}, whose kept values it reads")
    # Every action was unique and valid, and every required one was found: nothing extra is left.


def _check_collectives(s: Schedule) -> None:
    """Where collectives sit in each list, and that cross-stage ones are issued in one order."""
    done = Kind.WEIGHT if s.splits_backward else Kind.BACKWARD
    for r, acts in enumerate(s.actions):
        if not any(a.is_collective for a in acts):
            continue
        last_use: dict[int, int] = {}
        first_fwd: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.kind is Kind.FORWARD:
                first_fwd.setdefault(a.chunk, i)
            if a.kind is (done if s.has_backward else Kind.FORWARD):
                last_use[a.chunk] = i
        last_compute = max((i for i, a in enumerate(acts) if a.is_compute), default=-1)
        wait = next((i for i, a in enumerate(acts) if a.kind is Kind.WAIT_GRADS), None)
        for i, a in enumerate(acts):
            if a.kind in (Kind.ALL_REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS):
                if i < last_use.get(a.chunk, -1):
                    raise _fail(s, r, a, f"reduces chunk {a.chunk}'s gradients before its last backward")
                if wait is None or wait < i:
                    raise _fail(s, r, a, "no wg (wait for the gradient reductions) follows it")
            elif a.kind is Kind.WAIT_GRADS and i < last_compute:
                raise _fail(s, r, a, "waits for the gradients before the last backward ran")
            elif a.kind in (Kind.TIED_SUM, Kind.SP_SUM) and s.has_backward and (wait is None or i < wait):
                raise _fail(s, r, a, "sums gradients before the gradient reductions are waited for")
            elif a.kind is Kind.UNSHARD and i > first_fwd.get(a.chunk, len(acts)):
                raise _fail(s, r, a, f"gathers chunk {a.chunk}'s unit after its first forward")
            elif a.kind is Kind.RESHARD and i < last_use.get(a.chunk, -1):
                raise _fail(s, r, a, f"frees chunk {a.chunk}'s unit before its last use")
    # a collective over several stages: every member issues the shared ones in one order
    orders = [[a for a in acts if a.kind is Kind.TIED_SUM] for acts in s.actions]
    for r in range(s.pp):
        for q in range(r + 1, s.pp):
            mine = [a for a in orders[r] if a in orders[q]]
            theirs = [a for a in orders[q] if a in orders[r]]
            if mine != theirs:
                raise ScheduleError(f"schedule {_label(s)}: ranks {r} and {q} issue their tied-gradient sums "
                                    f"in different orders ({mine} vs {theirs}): they would deadlock")


def _check_matching(s: Schedule) -> None:
    """Messages from A to B are sent in the order B receives them."""
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind in SENDS:
                sent.setdefault((r, a.peer), []).append(a)
            elif a.kind in RECVS:
                received.setdefault((a.peer, r), []).append(a)
    for pair in sorted(set(sent) | set(received)):
        src, dst = pair
        outs, ins = sent.get(pair, []), received.get(pair, [])
        for k, (a, b) in enumerate(zip(outs, ins)):
            if a.message != b.message:
                raise _fail(s, src, a, f"is message {k} from rank {src} to rank {dst}, but rank {dst} "
                                       f"posts {b} as its receive {k} from rank {src}")
        if len(outs) != len(ins):
            raise ScheduleError(f"schedule {_label(s)}: rank {src} sends {len(outs)} messages to rank {dst} "
                                f"but rank {dst} posts {len(ins)} receives from it")
