"""runtime/dispatch.py: the prepared action list runs the same receives, actions and
messages, in the same order, as walking the receive plan per action did."""
from __future__ import annotations

import pytest
import torch

from threefold.runtime import dispatch, local_p2p
from threefold.runtime.receives import receive_plan
from threefold.runtime.schedule import Kind, make_schedule


class _Boundary:
    def __init__(self, key):
        self.key = key

    def recv_specs(self):
        return (((2, 3 + self.key[0]), torch.float32),)


class _Engine:
    """What dispatch reads of a PipelineEngine: stage, rank, boundaries, peers."""

    def __init__(self, schedule, stage):
        self.schedule, self.stage, self._programs = schedule, stage, {}
        self.groups = type("G", (), {"rank": 10 + stage})()

    def _boundary(self, chunk, side, grads=False):
        return _Boundary((chunk, side, grads))

    def _peer(self, stage):
        return 10 + stage


def _walked(actions, rx):
    """The order the engine ran things in before: per position, dict lookups."""
    out = []
    for i, a in enumerate(actions):
        out += [("post", j) for j in rx.post_before.get(i, ())]
        out += [("land", j) for j in rx.land_before.get(i, ())]
        if not a.is_recv:
            out.append(("run", i))
    return out + [("land", j) for j in rx.land_before.get(len(actions), ())]


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
def test_the_program_runs_what_the_receive_plan_says_in_its_order(kind, v):
    sched = make_schedule(kind, 4, 8, v)
    for stage in range(4):
        actions = sched.actions[stage]
        rx = receive_plan(actions)
        prog = dispatch.Program(_Engine(sched, stage), sched, rx)
        index = {id(a): i for i, a in enumerate(actions)}
        ran = []
        for posts, lands, k, a, compute in prog.steps:
            ran += [("post", j) for j, r in posts if r is actions[j]]
            ran += [("land", j) for j, r in lands if r is actions[j]]
            if k is not None:
                assert k is a.kind and compute == a.is_compute
                ran.append(("run", index[id(a)]))
        ran += [("land", j) for j, r in prog.tail]
        assert ran == _walked(actions, rx)
        moved = [a for a in actions if a.is_send or a.is_recv]
        assert moved and set(prog.messages) == {id(a) for a in moved}


def test_messages_name_the_boundary_peer_and_what_moves():
    sched = make_schedule("interleaved", 4, 8, 2)
    eng = _Engine(sched, 1)
    for a in sched.actions[1]:
        if not (a.is_send or a.is_recv):
            continue
        m = dispatch.message(eng, a)
        assert m.peer == 10 + a.peer
        side, grads = {Kind.SEND_ACT: ("outputs", False), Kind.SEND_GRAD: ("inputs", True),
                       Kind.RECV_ACT: ("inputs", False), Kind.RECV_GRAD: ("outputs", True)}[a.kind]
        assert m.boundary.key == (a.chunk, side, grads) and m.specs == m.boundary.recv_specs()
        kind, producer, mb = a.message    # a gradient is named by the chunk whose outputs it is for
        named = f"activations of chunk {producer}" if kind == "act" else f"gradients of chunk {producer - 1}"
        assert m.what == f"{named} microbatch {mb}"


def test_a_program_is_kept_per_schedule_and_remade_for_another_receive_plan():
    sched, fwd = make_schedule("1f1b", 2, 4), make_schedule("1f1b", 2, 2)
    eng = _Engine(sched, 0)
    rx = receive_plan(sched.actions[0])
    first = dispatch.program(eng, sched, rx)
    other = dispatch.program(eng, fwd, receive_plan(fwd.actions[0]))
    assert dispatch.program(eng, sched, rx) is first and other is not first
    assert dispatch.program(eng, sched, receive_plan(sched.actions[0], lookahead=0)) is not first


def test_layouts_are_cached_and_equal_for_lists_and_tuples():
    specs = [((2, 3), torch.float32), ((5,), torch.int64)]
    offsets, total = local_p2p.layout(specs)
    assert offsets == [0, 64] and total == 128
    assert local_p2p.layout(tuple((s, d) for s, d in specs)) == (offsets, total)
