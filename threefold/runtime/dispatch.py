"""One rank's action list, prepared once per schedule for the engine's step loop.

The step loop runs every action of every step; what it needs to run one does not change
between steps: which receives to post and land before it (runtime/receives.py), whether it
is a compute (sends are checked for completion after those), and for a message its
boundary, its receive shapes, the peer rank and the text a failure names it by. Working
these out per action and step cost the runtime's per-message path its dict lookups, list
and string building and property calls (issue 25: interleaved and ZB-V run twice 1F1B's
actions and messages); a `Program` holds them as a flat list of tuples instead.
"""
from __future__ import annotations

from dataclasses import dataclass

from threefold.runtime.boundary import Boundary
from threefold.runtime.receives import ReceivePlan
from threefold.runtime.schedule import Kind, Schedule


@dataclass(frozen=True, slots=True)
class Message:
    """What a send or receive action moves, and with whom."""
    boundary: Boundary
    specs: tuple            # the receive buffers' (shape, dtype): boundary.recv_specs()
    peer: int               # the peer's global rank
    what: str               # "activations of chunk 1 microbatch 2": a failure names it


def message(engine, a) -> Message:
    """The engine's boundary and peer for send or receive action `a`."""
    if a.kind is Kind.RECV_ACT:
        b, what = engine._boundary(a.chunk, "inputs"), f"activations of chunk {a.chunk - 1} microbatch {a.mb}"
    elif a.kind is Kind.RECV_GRAD:
        b, what = engine._boundary(a.chunk, "outputs", grads=True), f"gradients of chunk {a.chunk} microbatch {a.mb}"
    elif a.kind is Kind.SEND_ACT:
        b, what = engine._boundary(a.chunk, "outputs"), f"activations of chunk {a.chunk} microbatch {a.mb}"
    else:
        b, what = engine._boundary(a.chunk, "inputs", grads=True), f"gradients of chunk {a.chunk - 1} microbatch {a.mb}"
    return Message(b, b.recv_specs(), engine._peer(a.peer), what)


class Program:
    """`steps`: per action, (receives to post before it, receives to land before it, its
    kind or None for a receive (run by its landing), the action, whether it computes); a
    receive is (its position, its action). `tail`: the receives landed after the last action.
    `messages`: id(action) -> Message for every send and receive (the schedule holds the
    actions, so their ids stay theirs while the program lives)."""

    def __init__(self, engine, schedule: Schedule, rx: ReceivePlan):
        actions = schedule.actions[engine.stage]
        self.schedule, self.rx = schedule, rx
        self.steps = [(tuple((j, actions[j]) for j in rx.post_before.get(i, ())),
                       tuple((j, actions[j]) for j in rx.land_before.get(i, ())),
                       None if a.is_recv else a.kind, a, a.is_compute)
                      for i, a in enumerate(actions)]
        self.tail = tuple((j, actions[j]) for j in rx.land_before.get(len(actions), ()))
        self.messages = {id(a): message(engine, a) for a in actions if a.is_send or a.is_recv}


def program(engine, schedule: Schedule, rx: ReceivePlan) -> Program:
    """The engine's program for `schedule` and its receive plan, made once (a training and
    a forward-only schedule alternate: both are kept)."""
    cache = engine._programs
    prog = cache.get(id(schedule))
    if prog is None or prog.schedule is not schedule or prog.rx is not rx:
        if len(cache) >= 4:   # schedules passed per call: keep a few, not every one
            cache.clear()
        prog = cache[id(schedule)] = Program(engine, schedule, rx)
    return prog


def p2p_messages(engine) -> dict[tuple[int, int], list[int]]:
    """Per directed pair of ranks (sender, receiver) this rank is one end of, the bytes of
    each message of a step of the engine's schedule (runtime/local_p2p.open_links)."""
    from threefold.runtime import local_p2p   # lazy: start-up: runtime.local_p2p loads only on this path
    me, messages = engine.groups.rank, {}
    for a in engine.schedule.actions[engine.stage]:
        if a.is_send or a.is_recv:
            m = message(engine, a)
            pair = (me, m.peer) if a.is_send else (m.peer, me)
            messages.setdefault(pair, []).append(local_p2p.layout(m.specs)[1])
    return messages
