"""The engine's receive plan (runtime/receives.py): receives posted ahead of their place in
the list, in list order per peer, landed before the compute that reads them, and an
executor that posts them so and never blocks on a send cannot deadlock."""
import pytest

from threefold.runtime.receives import receive_plan
from threefold.runtime.schedule import Kind, make_schedule

READER = {Kind.RECV_ACT: Kind.FORWARD, Kind.RECV_GRAD: Kind.BACKWARD}


def _cases():
    for kind in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv"):
        for pp in (2, 3, 4):
            for m in (pp, 2 * pp, 2 * pp + 1):
                for v in ((2,) if kind in ("interleaved", "zbv") else (1,)):
                    if kind == "interleaved" and m % pp:
                        continue
                    yield kind, pp, m, v


CASES = list(_cases())


def _positions(plan, table: str) -> dict[int, int]:
    out = {}
    for pos, js in getattr(plan, table).items():
        for j in js:
            assert j not in out, f"receive {j} appears twice in {table}"
            out[j] = pos
    return out


@pytest.mark.parametrize("kind,pp,m,v", CASES)
@pytest.mark.parametrize("lookahead", [0, 1, 8])
def test_plan_posts_ahead_in_peer_order_and_lands_before_the_reader(kind, pp, m, v, lookahead):
    sched = make_schedule(kind, pp, m, v)
    for acts in sched.actions:
        plan = receive_plan(acts, lookahead)
        post, land = _positions(plan, "post_before"), _positions(plan, "land_before")
        recvs = [j for j, a in enumerate(acts) if a.is_recv]
        assert sorted(post) == recvs and sorted(land) == recvs
        for j in recvs:
            a = acts[j]
            reader = next(i for i, b in enumerate(acts) if b.kind is READER[a.kind]
                          and (b.chunk, b.mb) == (a.chunk, a.mb))
            assert post[j] <= j, f"{a} posted after its place in the list"
            assert land[j] == reader, f"{a} lands at {land[j]}, its reader {acts[reader]} is at {reader}"
            if lookahead == 0:
                assert post[j] == j
        by_peer: dict[int, list[int]] = {}
        for j in recvs:
            by_peer.setdefault(acts[j].peer, []).append(j)
        for peer, js in by_peer.items():
            posted = sorted(js, key=lambda j: (post[j], j))
            assert posted == js, f"receives from stage {peer} posted out of list order"


def test_lookahead_posts_earlier_than_the_list():
    acts = make_schedule("1f1b", 4, 8).actions[1]
    early = _positions(receive_plan(acts, 8), "post_before")
    assert sum(1 for j, p in early.items() if p < j) > len(early) // 2


def _run(sched, lookahead: int) -> None:
    """Execute every rank's list as the engine does: sends never block, receives are posted
    at their planned position and waited for where they land. Messages between two ranks
    match in posting order, and each must be the one the receive expects."""
    pp = sched.pp
    plans = [receive_plan(acts, lookahead) for acts in sched.actions]
    ops = []   # per rank: ("post", j) | ("land", j) | ("act", i), in execution order
    for acts, plan in zip(sched.actions, plans):
        seq = []
        for i in range(len(acts) + 1):
            seq += [("post", j) for j in plan.post_before.get(i, ())]
            seq += [("land", j) for j in plan.land_before.get(i, ())]
            if i < len(acts) and not acts[i].is_recv:
                seq.append(("act", i))
        ops.append(seq)
    sent = {(a, b): [] for a in range(pp) for b in range(pp)}      # messages in flight a -> b
    posted = {(a, b): [] for a in range(pp) for b in range(pp)}    # receives b posted from a
    matched: dict[tuple[int, int], object] = {}                    # (rank, j) -> message got
    pc = [0] * pp

    def deliver(r):   # the k-th message from src meets the k-th receive r posted from src
        for src in range(pp):
            while sent[(src, r)] and posted[(src, r)]:
                matched[(r, posted[(src, r)].pop(0))] = sent[(src, r)].pop(0)
    while any(pc[r] < len(ops[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            deliver(r)
            while pc[r] < len(ops[r]):
                op, j = ops[r][pc[r]]
                acts = sched.actions[r]
                if op == "post":
                    posted[(acts[j].peer, r)].append(j)
                elif op == "land":
                    if (r, j) not in matched:
                        break                                          # its bytes have not come
                    assert matched[(r, j)] == acts[j].message
                elif acts[j].is_send:
                    sent[(r, acts[j].peer)].append(acts[j].message)
                pc[r] += 1
                progressed = True
                deliver(r)
        assert progressed, f"{sched.name} pp={pp} m={sched.m}: deadlock at {[ops[r][pc[r]] for r in range(pp) if pc[r] < len(ops[r])]}"


@pytest.mark.parametrize("kind,pp,m,v", CASES)
def test_posted_receives_never_deadlock_and_match_their_messages(kind, pp, m, v):
    sched = make_schedule(kind, pp, m, v)
    for lookahead in (0, 2, 8):
        _run(sched, lookahead)
