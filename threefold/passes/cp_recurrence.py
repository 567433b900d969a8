"""Recurrences over time steps under cp: a Python loop unrolled in the trace, its state handed
rank to rank (plan `cp=N`; runtime/cp_recur.py).

`for t in range(T): h = f(h, x[:, t]); out[:, t] = g(h)` traces, at the local length n, as n
copies of the loop's body, step t reading local position t of the sequence-split values by
`select(x, dim, t)`. Found by data flow, never by names:

- a step read: a select of one local position along the sequence (the cp rule refuses it,
  passes/context_parallel.py records it here and places it as a value of that step);
- a value's step: the latest step it reads (ops that read only shapes, zeros_like, read none);
  the values of steps >= 0 read by one another form a loop (a connected component);
- its outputs go back along the sequence by `stack` / `cat` of one value per step (placed along
  the sequence again, `collect`) or by copies into positions of a buffer (`out[:, t] = ...`);
- rank r's two blocks are steps 0..b-1 (global block r, "A") and b..n-1 (block 2cp-1-r, "B"),
  b = n/2. The state at the block boundary is what A computes and B reads (S). Each step t of A
  is matched, op by op, with step t+b of B (the same ops on positions b further, the same
  constants); where a value of A's first steps that no step computes (position-free: zeros, a
  constant, a table) stands where B reads a value of S, it is the initial state bound to that
  state. Every value B computes must match one of A (the steps are the loop's one body); a
  value of A without a match may only feed the state (its match was in the last step's update,
  which the trace dropped as unread);
- the rewrite: A starts from `recur_start` (the model's initial state on rank 0, rank r-1's end
  of A elsewhere), B from `recur_mid` (rank r+1's end of B, its own end of A on the last rank),
  and the end of B, which the trace does not compute, is a copy of A's state computation on B's
  positions from B's start, handed to rank r-1 by `recur_end` beside the last step's output.

The steps run one block after the other across the ranks (exact, not overlapped). Where the
loop's shape makes an exact hand-off impossible the PlanError names why (`finish`).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ops.families import JOINS, METADATA_CHECKS, READS_SHAPE_ONLY, SHAPE_QUERIES, args_of, op_name
from threefold.passes.cp_loop_match import derives, hoist, meta_like, refine, same, writes_into
from threefold.passes.cp_masks import input_free
from threefold.passes.cp_rules.core import Seq
from threefold.runtime import cp_recur
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")
_NO_VALUE = READS_SHAPE_ONLY | METADATA_CHECKS | SHAPE_QUERIES   # read no tensor value


@dataclass
class Loops:
    """What the walk saw: step reads (select node -> (source, dim, t)), the refusal each would
    have been, and the stacks that put one value per step back along the sequence."""
    reads: dict = field(default_factory=dict)
    width: dict = field(default_factory=dict)    # a step read by slice -> positions per step (select: 1)
    why: dict = field(default_factory=dict)
    stacks: dict = field(default_factory=dict)
    count: int = 0
    handed: list = field(default_factory=list)   # per loop: elements of its state
    token: object = None                         # the last loop's recur_end token (orders the backward)


def loops_of(w) -> Loops:
    return w.ctx.setdefault("recur", Loops())


def step_read(w, node: fx.Node, why: str) -> bool:
    """Record `node` as a step read where it selects one local position (0..n-1) along the
    sequence of a sequence-split value, or slices a block of it (`x[:, lo:lo + L]`, a loop over
    blocks of L positions, L dividing n/2, the value read block by block: `block_step`); True
    where it did (it is then placed off the sequence)."""
    name = op_name(node) if node.op == "call_function" else None
    if name not in ("select", "slice"):
        return False
    a = args_of(node)
    src, s = a["self"], w.state.get(a["self"])
    v = src.meta.get("val") if isinstance(src, fx.Node) else None
    if not isinstance(s, Seq) or s.inner != 1 or not isinstance(v, torch.Tensor):
        return False
    dim = a["dim"] % v.dim()
    if dim != s.dim:
        return False
    if name == "slice":
        t, width = block_step(node, w.stage.seq_len), node.meta["val"].shape[dim]
        if t is None:
            return False
    else:
        t, width = a["index"], 1
        if not isinstance(t, int) or not 0 <= t < v.shape[dim]:
            return False
    loops = loops_of(w)
    loops.reads[node] = (src, dim, t)
    loops.width[node] = width
    loops.why[node] = why
    return True


def block_step(node: fx.Node, n: int):
    """The step of a slice `x[lo:lo + L]` along x's sequence dim of n positions read block by
    block (x's slices there cover 0..n in blocks of L, L < n dividing n/2): lo // L, else None.
    A lone slice (a shift x[:, :-1], a head x[:, :k]) is not a step."""
    a = args_of(node)
    src, dim = a["self"], a["dim"]
    lo, hi = a["start"] or 0, a["end"]
    if not isinstance(lo, int) or not isinstance(hi, int) or a["step"] != 1 or lo < 0 or hi <= lo:
        return None
    width = hi - lo
    if width >= n or (n // 2) % width or n % 2 or lo % width:
        return None
    rank = src.meta["val"].dim()
    starts = set()
    for u in src.users:
        if u.op == "call_function" and op_name(u) == "slice":
            b = args_of(u)
            if b["dim"] % rank == dim % rank and b["step"] == 1 and isinstance(b["start"] or 0, int) \
                    and b["end"] == (b["start"] or 0) + width:
                starts.add(b["start"] or 0)
    return lo // width if starts == set(range(0, n, width)) else None


def collect(w, node: fx.Node):
    """`stack(ys, d)` / `cat([y.unsqueeze(d) ...], d)` of one value per step, in step order,
    each placed off the sequence: the loop's output back along the sequence, Seq(d); else None."""
    loops = w.ctx.get("recur") if w.ctx else None
    if not loops or not loops.reads or node.op != "call_function" or op_name(node) not in JOINS:
        return None
    a = args_of(node)
    ys, n = list(a["tensors"]), w.stage.seq_len
    if not ys or any(not isinstance(y, fx.Node) or w.state.get(y) is not None for y in ys):
        return None
    out = node.meta.get("val")
    d = a.get("dim", 0) % out.dim()
    width = ys[0].meta["val"].shape[d] if op_name(node) == "cat" else 1   # a cat of blocks of L positions
    if len(ys) * width != n or any(op_name(node) == "cat" and y.meta["val"].shape[d] != width for y in ys):
        return None
    steps = _steps(node.graph, loops)
    if [steps.get(y, -1) for y in ys] != list(range(len(ys))):
        return None
    loops.stacks[node] = ys
    return Seq(d)


def _steps(graph: fx.Graph, loops: Loops) -> dict:
    """node -> the latest step it reads (values that read no step are left out)."""
    steps = {}
    for x in graph.nodes:
        if x in loops.reads:
            steps[x] = loops.reads[x][2]
        elif x.op == "call_function" and op_name(x) not in _NO_VALUE and x not in loops.stacks:
            t = max((steps.get(a, -1) for a in x.all_input_nodes), default=-1)
            if t >= 0:
                steps[x] = t
    return steps


def _components(steps: dict) -> list:
    """The loops: values of steps read by one another, connected (graph order kept)."""
    parent = {x: x for x in steps}

    def root(x):
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for x in steps:
        for a in x.all_input_nodes:
            if a in steps:
                parent[root(a)] = root(x)
    groups = defaultdict(list)
    for x in steps:
        groups[root(x)].append(x)
    return list(groups.values())


def finish(w) -> int:
    """Rewrite every loop of step reads the walk recorded (module docstring); a loop that
    cannot be handed exactly is the PlanError its first read would have been, with why."""
    loops = w.ctx.get("recur") if w.ctx else None
    if not loops or not loops.reads:
        return 0
    graph = w.gm.graph
    steps = _steps(graph, loops)
    order = {x: i for i, x in enumerate(graph.nodes)}
    for comp in sorted(_components(steps), key=lambda c: min(order[x] for x in c)):
        reads = [x for x in comp if x in loops.reads and not _shape_only(x)]
        if not reads:
            continue
        first = min(reads, key=order.get)
        order = {x: i for i, x in enumerate(graph.nodes)}   # the loops before inserted and moved nodes
        why = _Loop(w, comp, steps, loops, order).rewrite()
        if why is not None:
            text = loops.why[first] + (f"; cp cannot hand its state rank to rank: {why}" if why else "")
            raise PlanError(w.refusal(first, text))
        loops.count += 1
    return loops.count


def _shape_only(x: fx.Node) -> bool:
    """A read nothing reads but for its shape (zeros_like(x[:, 0]): a state's initial zeros)."""
    return all(op_name(u) in _NO_VALUE for u in x.users)


class _Loop:
    """One loop's analysis and rewrite; `rewrite` returns None (done), "" (not a loop over
    every local position: the plain refusal) or why the hand-off is impossible."""

    def __init__(self, w, comp: list, steps: dict, loops: Loops, order: dict):
        self.w, self.loops, self.steps, self.order = w, loops, steps, order
        self.graph = w.gm.graph
        self.comp = sorted((x for x in comp if not (x in loops.reads and _shape_only(x))), key=order.get)
        self.inside = set(self.comp)
        self.reads = {x: loops.reads[x] for x in self.comp if x in loops.reads}
        widths = {loops.width.get(x, 1) for x in self.reads}
        self.width = widths.pop() if len(widths) == 1 else 0   # positions per step (0: steps of several widths)
        self.n = w.stage.seq_len // self.width if self.width else 0   # steps per rank
        self.b = self.n // 2
        self.A = [x for x in self.comp if steps[x] < self.b]
        self.B = [x for x in self.comp if steps[x] >= self.b]
        self.inA, self.inB = set(self.A), set(self.B)
        self.S = [x for x in self.A if any(u in self.inB for u in x.users)]
        self.inS = set(self.S)
        self.memo = {}

    # -- checks ----------------------------------------------------------------------------

    def rewrite(self):
        if not self.n or {t for _, _, t in self.reads.values()} != set(range(self.n)) or self.n % 2:
            return ""
        why = self._writes_ok() or self._outside_ok()
        if why:
            return why
        bound, same, why = self._match()
        if why:
            return why
        derived = self._derived(bound)
        why = self._initial_ok(bound, derived, same) or self._untangle()
        if why:
            return why
        return self._apply(bound, derived)

    def _untangle(self):
        """Values of A the trace computes inside B's steps (the decay added to a state for the
        next step's update belongs to the step before by what it reads) move before B's first."""
        first_b = next((h for h in self.B if h not in self.reads), None)
        if first_b is None:
            return None
        late = [g for g in self.A if self.order[g] > self.order[first_b]]
        for g in late:   # a position-free value it reads (the block's decay, exp(-slope * L)) moves along
            if any(a not in self.inA and self.order[a] > self.order[first_b]
                   and (a in self.inside or not hoist(a, first_b, self.order, self.inside)) for a in g.all_input_nodes):
                return f"{op_name(g)} of step {self.steps[g]} reads a value made after the next block starts"
        for g in late:
            first_b.prepend(g)
        self.order = {x: i for i, x in enumerate(self.graph.nodes)}
        return None

    def _writes_ok(self):
        """Outputs written into positions of a buffer are only written, each position once;
        the writes and stacked values are the loop's outputs (`self.outs`)."""
        self.outs, self.last = [], None
        by_src = defaultdict(list)
        for x, (src, _, t) in self.reads.items():
            by_src[src].append((x, t))
        for src, xs in by_src.items():
            writes = [(x, t) for x, t in xs if any(writes_into(u, x) for u in x.users)]
            if not writes:
                continue
            if len(writes) != len(xs) or any(not all(writes_into(u, x) for u in x.users) for x, _ in xs) \
                    or sorted(t for _, t in writes) != list(range(self.n)):
                return "it reads positions of a value it also writes"
            for x, t in writes:
                for u in x.users:
                    self.outs.append(u)
                    if t == self.n - 1:
                        self.last = (u, args_of(u)["src"])
        for st, ys in self.loops.stacks.items():
            if ys[0] in self.inside:
                self.outs.extend(ys)
                self.last = self.last or (st, ys[-1])
        if self.last is None:
            return ("its steps' values do not go back along the sequence in step order (a stack or writes into "
                    "positions, step t's value at position t; does a step read a later position?)")
        return None

    def _outside_ok(self):
        """Values of the loop are read after it only by its output stacks (or for their shapes)."""
        stacked = {y for st, ys in self.loops.stacks.items() for y in ys}
        for x in self.comp:
            if op_name(x).endswith("_") and op_name(x) != "copy_":
                return f"updates a value in place ({op_name(x)})"
            for u in x.users:
                if u not in self.inside and op_name(u) not in _NO_VALUE and not (x in stacked and u in self.loops.stacks):
                    return f"{op_name(u)} reads a value of step {self.steps[x]} after the loop (its final state?)"
        return None

    def _match(self):
        """Step t of A against step t+b of B: (bound: initial value -> state of S, values matched
        as themselves, why not where the steps differ)."""
        cands = defaultdict(list)
        for h in self.B:
            if h not in self.reads:
                cands[(h.target, self.steps[h])].append(h)
        images, bound, same = set(), defaultdict(set), set()
        feeds_out = self._feeds_outputs()
        pairs = {g: [h for h in cands[(g.target, self.steps[g] + self.b)] if self._node(g, h) is not None]
                 for g in self.A if g not in self.reads}
        refine(pairs)
        for g, found in pairs.items():
            for h in found:
                images.add(h)
                for kind, a, c in self._node(g, h):
                    (bound[a].add(c) if kind == "bind" else same.add(a))
            if not found and g in feeds_out:
                return None, None, (f"step {self.steps[g]} computes {op_name(g)} where step {self.steps[g] + self.b} "
                                    "computes nothing the same (the steps are not one loop body)")
        for h in self.B:
            if h not in self.reads and h not in images:
                return None, None, (f"step {self.steps[h]} computes {op_name(h)} that step {self.steps[h] - self.b} "
                                    "does not (the steps are not one loop body)")
        one = {}
        for a, cs in bound.items():
            if len(cs) != 1:
                return None, None, f"its initial value {a.name} stands for {len(cs)} different states"
            one[a] = next(iter(cs))
        if len(set(one.values())) != len(one):
            return None, None, "two initial values stand for the same state"
        for a in sorted(one, key=self.order.get, reverse=True):   # made from other initial values as its
            rest = {x: c for x, c in one.items() if x is not a}  # state is from theirs: recomputed instead
            if derives(a, one[a], rest, 8):
                del one[a]
        return one, same, None

    def _feeds_outputs(self) -> set:
        """Values of A that reach an output of A (a write or a stacked value) within A."""
        seen, stack = set(), [o for o in self.outs if o in self.inA]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            stack.extend(a for a in x.all_input_nodes if a in self.inA)
        return seen

    def _node(self, g, h):
        """The bindings under which h (step t+b) computes what g (step t) does, or None."""
        key = (g, h)
        if key not in self.memo:
            self.memo[key] = None
            binds = []
            ok = (g.target == h.target and len(g.args) == len(h.args) and set(g.kwargs) == set(h.kwargs)
                  and all(self._arg(a, c, binds) for a, c in zip(g.args, h.args))
                  and all(self._arg(g.kwargs[k], h.kwargs[k], binds) for k in g.kwargs))
            self.memo[key] = binds if ok else None
        return self.memo[key]

    def _arg(self, a, c, binds: list) -> bool:
        if isinstance(a, (list, tuple)):
            return type(a) is type(c) and len(a) == len(c) and all(self._arg(x, y, binds) for x, y in zip(a, c))
        if not isinstance(a, fx.Node) or not isinstance(c, fx.Node):
            return not isinstance(a, fx.Node) and not isinstance(c, fx.Node) and a == c
        if a in self.reads:
            ra, rc = self.reads[a], self.reads.get(c)
            return rc is not None and rc[0] is ra[0] and rc[1] == ra[1] and rc[2] == ra[2] + self.b
        if a in self.inA:
            got = self._node(a, c) if c in self.inB and c not in self.reads else None
            if got is None:
                return False
            binds.extend(got)
            return True
        if c in self.inS:                # a position-free value where B reads the state: the initial state
            binds.append(("bind", a, c))
            return True
        if c in self.inside or not (c is a or same(a, c, 6)):
            return False
        binds.append(("same", a, None))
        return True

    def _derived(self, bound: dict) -> set:
        """Position-free values computed from initial values (sub(zeros, 1e38) + decay): recomputed
        from the state each block starts with."""
        out = set()
        for x in self.graph.nodes:
            if x.op == "call_function" and x not in self.inside and x not in bound and op_name(x) not in _NO_VALUE \
                    and any(a in bound or a in out for a in x.all_input_nodes):
                out.add(x)
        return out

    def _initial_ok(self, bound: dict, derived: set, same: set):
        init = set(bound) | derived
        for a in bound:   # rank 0 starts from it as it is: it must be the same whole value on every rank
            if self.w.state.get(a) is not None:
                return f"its initial value {a.name} is itself split across the ranks"
        if init & same:
            return f"it reads its initial value {sorted(x.name for x in init & same)[0]} at every step"
        for h in self.B:
            for a in h.all_input_nodes:
                if a in init:
                    return f"step {self.steps[h]} reads the initial value {a.name}"
        seen_at = defaultdict(set)
        for d in init:   # read where an initial value is made (w * num0): a constant of the update
            for a in d.all_input_nodes:
                seen_at[a].update((-1, -2))
        for g in self.A:
            for a in g.all_input_nodes:
                if a not in self.inside:
                    seen_at[a].add(self.steps[g])
        for g in self.A:   # values only A reads and no match vouches for: a constant of every step, or not?
            if g in self.reads:
                continue
            for a in g.all_input_nodes:
                if a not in self.inside and a not in init and a not in same and len(seen_at[a]) < 2 \
                        and a.op == "call_function" and not self._constant(a, seen_at):
                    return (f"cannot tell whether {a.name}, read at step {self.steps[g]} only, is its initial state "
                            "or a constant of every step")
        return None

    def _constant(self, a, seen_at: dict) -> bool:
        """A value read at one step only (each block re-slices its decay table: a node per step, and
        the last step's update, which would read the next, was dropped as unread) is a constant of
        every step where the same value is read at another step, or where it is input-free and no
        value of the loop has its shape (a state is carried in values of its own shape)."""
        steps = seen_at[a]
        if any(b is not a and seen_at[b] - steps and same(a, b, 6) for b in seen_at):
            return True
        shape = tuple(a.meta["val"].shape) if isinstance(a.meta.get("val"), torch.Tensor) else None
        return shape is not None and input_free(a) and all(
            tuple(x.meta["val"].shape) != shape for x in self.comp if isinstance(x.meta.get("val"), torch.Tensor))

    # -- the rewrite -----------------------------------------------------------------------

    def _apply(self, bound: dict, derived: set):
        graph, order, w = self.graph, self.order, self.w
        init = set(bound) | derived
        hand = sorted(set(bound.values()), key=order.get)          # what a block's start is made of
        reps = {s: min((a for a in bound if bound[a] is s), key=order.get) for s in hand}
        users_of_init = [g for g in self.A if g not in self.reads and any(a in init for a in g.all_input_nodes)]
        first = min(users_of_init, key=order.get) if users_of_init else None
        anchors = [x for x in self.reads if self.reads[x][2] == 0 and (first is None or order[x] < order[first])]
        last_s = max(self.S, key=order.get) if self.S else None
        readers_s = [h for h in self.B if any(a in self.inS for a in h.all_input_nodes)]
        out_node, last_y = self.last
        if first is not None and any(order[reps[s]] > order[first] for s in hand):
            for s in hand:   # an initial value made inside the first step (w * den0 after num's update): earlier
                if not hoist(reps[s], first, order, self.inside):
                    return "its initial state is made after its first step reads it"
            self.order = order = {x: i for i, x in enumerate(graph.nodes)}
        if first is not None and not anchors:
            return "its first step reads its initial state before the sequence"
        token = self.loops.token
        if token is not None and first is not None and order[token] > order[first]:
            return "it starts before the loop before it ends (two loops' steps interleave)"
        anchors += [token] if token is not None and first is not None else []
        if readers_s and (order[last_s] > min(order[h] for h in readers_s) or order[last_s] > order[out_node]):
            return "its blocks' steps interleave (a step reads the state before the previous block ends)"
        new = []
        ranks = w.stage.plan.cp
        # B starts from recur_mid
        mid = {}
        if self.S:
            with graph.inserting_after(last_s):
                op = graph.call_function(cp_recur.recur_mid, (list(self.S), [self.S.index(s) for s in hand], CP),
                                         {"ranks": ranks})
            op.meta = {"val": tuple(s.meta["val"] for s in self.S), "tf": dict(tf(last_s))}
            new.append(op)
            prev = op
            for i, s in enumerate(self.S):
                with graph.inserting_after(prev):
                    got = graph.call_function(operator.getitem, (op, i))
                got.meta = meta_like(s)
                new.append(got)
                mid[s], prev = got, got
            for h in readers_s:
                for a in list(h.all_input_nodes):
                    if a in self.inS:
                        h.replace_input_with(a, mid[a])
            # the end of B: A's state computation again, on B's positions, from B's start
            ends = self._end_of_b(bound, derived, mid, out_node, new)
            with graph.inserting_before(out_node):
                end = graph.call_function(cp_recur.recur_end, (last_y, ends, CP), {"ranks": ranks})
                y = graph.call_function(operator.getitem, (end, 0))
                tok = graph.call_function(operator.getitem, (end, 1))
            val = last_y.meta["val"]
            end.meta = {"val": (val, val.new_zeros(())), "tf": dict(tf(last_y))}
            y.meta, tok.meta = meta_like(last_y), {"val": val.new_zeros(()), "tf": dict(tf(last_y))}
            new += [end, y, tok]
            out_node.replace_input_with(last_y, y)
            self.loops.token = tok
        # A starts from recur_start
        start = {}
        if first is not None:
            with graph.inserting_before(first):
                op = graph.call_function(cp_recur.recur_start, ([reps[s] for s in hand], anchors, CP), {"ranks": ranks})
            op.meta = {"val": tuple(reps[s].meta["val"] for s in hand), "tf": dict(tf(first))}
            new.append(op)
            for i, s in enumerate(hand):
                with graph.inserting_after(op if i == 0 else new[-1]):
                    got = graph.call_function(operator.getitem, (op, i))
                got.meta = meta_like(reps[s])
                new.append(got)
                for a in bound:
                    if bound[a] is s:
                        start[a] = got
        clones_a = {}
        for g in self.A:
            if g not in self.reads:
                for a in list(g.all_input_nodes):
                    if a in init:
                        g.replace_input_with(a, self._initial(a, start, derived, clones_a, g, new))
        for x in new:
            w.state[x] = None
        self.loops.handed.append(sum(s.meta["val"].numel() for s in self.S))
        return None

    def _initial(self, a, start: dict, derived: set, cache: dict, before, new: list):
        """What A reads instead of the initial value `a`: the start state, or a value computed
        from it (a derived one, copied before `before`)."""
        if a in start:
            return start[a]
        if a not in cache:
            with self.graph.inserting_before(before):
                x = self.graph.node_copy(a, lambda y: self._initial(y, start, derived, cache, before, new)
                                         if (y in start or y in derived) else y)
            x.meta = meta_like(a)
            new.append(x)
            cache[a] = x
        return cache[a]

    def _end_of_b(self, bound: dict, derived: set, mid: dict, before, new: list) -> list:
        """The state B ends with, computed before `before`: every value of A that the state is
        made of, copied with positions moved b on and the initial state replaced by B's start."""
        graph = self.graph
        need, stack = set(), list(self.S)
        while stack:
            x = stack.pop()
            if x in need or x not in self.inA:
                continue
            need.add(x)
            stack.extend(x.all_input_nodes)
        start = {a: mid[s] for a, s in bound.items()}
        m, cache = {}, {}

        def arg(y):
            if y in m:
                return m[y]
            if y in start or y in derived:
                return self._initial(y, start, derived, cache, before, new)
            return y
        for x in self.A:
            if x not in need:
                continue
            if x in self.reads:
                src, dim, t = self.reads[x]
                at, L = t + self.b, self.width
                with graph.inserting_before(before):
                    y = graph.call_function(torch.ops.aten.select.int, (src, dim, at)) if op_name(x) == "select" \
                        else graph.call_function(torch.ops.aten.slice.Tensor, (src, dim, at * L, (at + 1) * L))
            else:
                with graph.inserting_before(before):
                    y = graph.node_copy(x, arg)
            y.meta = meta_like(x)
            new.append(y)
            m[x] = y
        return [m[s] for s in self.S]
