"""Cross-check what every rank of a job issued (runtime/dry_run.py's logs): collectives
agree within every process group, every send has its receive.

The rules, applied to the operations the ranks actually issued:

  * within every process group, every member issues the same collectives on it in the same
    order, with the same op, shapes (what each member contributes) and dtype; a broadcast's
    source is the same rank; an all-to-all's splits agree (what i sends to j is what j
    expects from i);
  * for every ordered pair of ranks, the messages A sends to B are, in order and shape,
    the messages B receives from A.

A mismatch names the two ranks, the group, the op index and both calls. When every group
agrees, the orders across groups are run as the backend runs them (runtime/dry_order.py):
two ranks that enter two shared groups in opposite orders deadlock, and are named.

Rank classes. The ranks of one pipeline stage load the same generated chunk modules (the
tp, cp, ep and dp coordinates are runtime values of one program) and run the same schedule
action list, so what they issue differs only in which groups and peers it names. Written
relative to the rank (`relative_ops`: a group as its members' coordinates with the axes
it does not span left to the rank; a peer as its coordinate offset, modulo each axis),
the lists of two such ranks are equal when the coordinates do not change any shape or
decision. `classes_of` takes one class per stage and two witnesses of it (every non-pp
coordinate at 0, and every one at its last index: the index where a ceiling split is
short); `check_classes` proves them equal before the class stands for its stage. Every
group of the job is then checked, each with its members' lists (groups whose members
have the same classes and the same relative group give the same answer and are compared
once, the count of groups covered is reported).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from threefold.runtime.comm_log import CommOp

P2P = ("send", "recv")


class Digits:
    """Mixed-radix coordinates of a mesh (outermost axis first)."""

    def __init__(self, axes: tuple[tuple[str, int], ...]):
        self.names = [n for n, _ in axes]
        self.sizes = [s for _, s in axes]
        self.world = 1
        for s in self.sizes:
            self.world *= s

    def of(self, rank: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.sizes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank(self, digits) -> int:
        r = 0
        for d, s in zip(digits, self.sizes):
            r = r * s + d
        return r


def relative_group(group: tuple, digits: Digits) -> tuple:
    """A group (ranks, occurrence) as its members' coordinates, None on every axis where all
    members share one coordinate (the rank's own): the same value for every translate."""
    ranks, k = group
    ds = [digits.of(r) for r in ranks]
    fixed = [all(d[i] == ds[0][i] for d in ds) for i in range(len(digits.sizes))]
    return (tuple(tuple(None if fixed[i] else d[i] for i in range(len(d))) for d in ds), k)


def absolute_group(rel: tuple, rank_digits: tuple, digits: Digits) -> tuple:
    members, k = rel
    return (tuple(digits.rank(tuple(rank_digits[i] if x is None else x for i, x in enumerate(m)))
                  for m in members), k)


def offset(a: tuple, b: tuple, digits: Digits) -> tuple:
    return tuple((y - x) % s for x, y, s in zip(a, b, digits.sizes))


def moved(a: tuple, off: tuple, digits: Digits) -> tuple:
    return tuple((x + o) % s for x, o, s in zip(a, off, digits.sizes))


def relative_ops(ops: list[CommOp], rank: int, digits: Digits) -> list[tuple]:
    """The rank's ops with groups and peers written relative to it (see the module doc)."""
    me = digits.of(rank)
    cache: dict[tuple, tuple] = {}
    out = []
    for op in ops:
        if op.op in P2P:
            out.append((op.op, offset(me, digits.of(op.peer), digits), op.shape, op.dtype, op.splits))
            continue
        rel = cache.get(op.group)
        if rel is None:
            rel = cache[op.group] = relative_group(op.group, digits)
        src = op.group[0].index(op.peer) if op.op == "broadcast" and op.peer in op.group[0] else -1
        out.append((op.op, rel, op.shape, op.dtype, op.splits, src, op.blocking))
    return out


@dataclass
class Mismatch:
    kind: str            # "collective" or "p2p" or "class"
    ranks: tuple         # the two ranks
    group: str           # the group (or the pair)
    index: int           # op index within the group's (or pair's) sequence
    calls: tuple         # the two calls, described (None: no call)

    def __str__(self) -> str:
        a, b = self.ranks
        ca, cb = (c if c is not None else "nothing" for c in self.calls)
        if self.kind == "p2p":
            return (f"rank {a} and rank {b} disagree at message {self.index} from {a} to {b}: "
                    f"rank {a} issues {ca}, rank {b} issues {cb}")
        if self.kind == "class":
            return (f"ranks {a} and {b} (one stage) issue different lists at op {self.index}: "
                    f"{ca} vs {cb}; run every rank (all_ranks) to check this job")
        return (f"rank {a} and rank {b} disagree on {self.group} at its collective {self.index}: "
                f"rank {a} issues {ca}, rank {b} issues {cb}")


@dataclass
class CheckResult:
    groups: int = 0                # process groups checked (every group any rank issued on)
    group_checks: int = 0          # distinct comparisons made (deduplicated by class)
    pairs: int = 0                 # ordered rank pairs with messages
    collectives: int = 0           # collective calls over the job (members x calls)
    messages: int = 0              # sends over the job
    mismatches: list[Mismatch] = field(default_factory=list)
    deadlock: object = None        # runtime/dry_order.Deadlock: groups entered in opposite orders

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.deadlock is None


def _describe_rel(op: tuple, rank: int, digits: Digits) -> str:
    """A relative op as the absolute call it is on `rank`."""
    if op[0] in P2P:
        peer = digits.rank(moved(digits.of(rank), op[1], digits))
        return CommOp(op[0], (), op[2], op[3], peer).describe()
    group = absolute_group(op[1], digits.of(rank), digits)
    src = group[0][op[5]] if op[5] >= 0 else -1
    return CommOp(op[0], group, op[2], op[3], src, op[4]).describe() + ("" if op[6] else " (async)")


def _same(a: tuple, b: tuple) -> bool:
    """Two members' calls agree (all-to-all splits are checked pairwise, not here)."""
    return a[0] == b[0] and a[2] == b[2] and a[3] == b[3] and (a[0] != "broadcast" or a[5] == b[5])


def check_job(rel: dict[int, list[tuple]], class_of, digits: Digits, limit: int = 20) -> CheckResult:
    """Cross-check the job. `rel[q]`: class q's relative ops; `class_of(rank)` -> q."""
    res = CheckResult()
    by_group: dict[int, dict[tuple, list[tuple]]] = {}     # class -> rel group -> its ops
    p2p: dict[int, dict[tuple, list[tuple]]] = {}          # class -> (kind, offset) -> messages
    for q, ops in rel.items():
        g, m = by_group.setdefault(q, {}), p2p.setdefault(q, {})
        for op in ops:
            if op[0] in P2P:
                m.setdefault((op[0], op[1]), []).append(op)
            else:
                g.setdefault(op[1], []).append(op)
    # -- collectives: enumerate every group any rank issued on, compare its members' lists
    seen_groups: set[tuple] = set()
    done: set[tuple] = set()
    for r in range(digits.world):
        q = class_of(r)
        mine = digits.of(r)
        for relg in by_group[q]:
            group = absolute_group(relg, mine, digits)
            if group in seen_groups:
                continue
            seen_groups.add(group)
            res.groups += 1
            members = group[0]
            key = (relg, tuple(class_of(x) for x in members))
            lists = [by_group[class_of(x)].get(relg, []) for x in members]
            res.collectives += sum(len(x) for x in lists)
            if key in done:
                continue
            done.add(key)
            res.group_checks += 1
            _compare_group(res, group, members, lists, digits, limit)
    # -- point to point: for every rank and every peer it names, sends == the peer's receives
    done = set()
    for r in range(digits.world):
        q = class_of(r)
        mine = digits.of(r)
        for (kind, off), msgs in p2p[q].items():
            peer = digits.rank(moved(mine, off, digits))
            sender, receiver = (r, peer) if kind == "send" else (peer, r)
            if kind == "send":
                res.pairs += 1
                res.messages += len(msgs)
            key = (class_of(sender), class_of(receiver), off if kind == "send" else
                   offset(digits.of(sender), digits.of(receiver), digits))
            if key in done:
                continue
            done.add(key)
            to = offset(digits.of(sender), digits.of(receiver), digits)
            back = offset(digits.of(receiver), digits.of(sender), digits)
            sends = p2p[class_of(sender)].get(("send", to), [])
            recvs = p2p[class_of(receiver)].get(("recv", back), [])
            for i in range(max(len(sends), len(recvs))):
                s = sends[i] if i < len(sends) else None
                v = recvs[i] if i < len(recvs) else None
                if s is None or v is None or s[2:4] != v[2:4]:
                    if len(res.mismatches) < limit:
                        res.mismatches.append(Mismatch(
                            "p2p", (sender, receiver), f"ranks {sender} -> {receiver}", i,
                            (_describe_rel(s, sender, digits) if s else None,
                             _describe_rel(v, receiver, digits) if v else None)))
                    break
    return res


def _compare_group(res: CheckResult, group: tuple, members: tuple, lists: list, digits: Digits,
                   limit: int) -> None:
    first, ref = members[0], lists[0]
    where = CommOp("all_reduce", group, (), "").describe().split(" on ", 1)[1]
    for x, ops in zip(members[1:], lists[1:]):
        for i in range(max(len(ref), len(ops))):
            a = ref[i] if i < len(ref) else None
            b = ops[i] if i < len(ops) else None
            if a is None or b is None or not _same(a, b):
                if len(res.mismatches) < limit:
                    res.mismatches.append(Mismatch(
                        "collective", (first, x), where, i,
                        (_describe_rel(a, first, digits) if a else None,
                         _describe_rel(b, x, digits) if b else None)))
                break
    # all-to-all: member i's input split for j == member j's output split for i, call by call
    n = len(members)
    for i_call, a in enumerate(ref):
        if a[0] != "all_to_all" or any(len(ops) <= i_call or ops[i_call][0] != "all_to_all" for ops in lists):
            continue
        for i in range(n):
            for j in range(n):
                sent, expected = lists[i][i_call][4][1][j], lists[j][i_call][4][0][i]
                if sent != expected and len(res.mismatches) < limit:
                    res.mismatches.append(Mismatch(
                        "collective", (members[i], members[j]), where, i_call,
                        (f"all_to_all sends {sent} rows to rank {members[j]}",
                         f"all_to_all expects {expected} rows from rank {members[i]}")))
                    return


def check_classes(rel: dict[int, list[tuple]], witnesses: dict[int, list[int]], limit: int = 20) -> list[Mismatch]:
    """Each class's witnesses issued equal relative lists (the class stands for its members)."""
    out: list[Mismatch] = []
    for q, others in witnesses.items():
        for w in others:
            a, b = rel[q], rel[w]
            for i in range(max(len(a), len(b))):
                x = a[i] if i < len(a) else None
                y = b[i] if i < len(b) else None
                if x != y:
                    if len(out) < limit:
                        out.append(Mismatch("class", (q, w), "", i, (str(x), str(y))))
                    break
    return out


def classes_of(digits: Digits, pp_axis: str = "pp") -> tuple[list[int], dict[int, list[int]], callable]:
    """(representatives, witnesses per representative, rank -> its representative): one
    class per pipeline stage (see the module doc)."""
    i_pp = digits.names.index(pp_axis) if pp_axis in digits.names else None
    stages = digits.sizes[i_pp] if i_pp is not None else 1
    reps, witnesses = [], {}
    for s in range(stages):
        zero = [0] * len(digits.sizes)
        last = [n - 1 for n in digits.sizes]
        if i_pp is not None:
            zero[i_pp] = last[i_pp] = s
        q, w = digits.rank(zero), digits.rank(last)
        reps.append(q)
        witnesses[q] = [w] if w != q else []

    def class_of(rank: int) -> int:
        if i_pp is None:
            return reps[0]
        d = [0] * len(digits.sizes)
        d[i_pp] = digits.of(rank)[i_pp]
        return digits.rank(d)
    return reps, witnesses, class_of
