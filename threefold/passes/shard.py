"""The sharding pass: every mesh axis's rules applied by one walker.

An axis names its rules module in its mesh entry (runtime/mesh.py `Axis.rules`, a module path:
the runtime imports no pass); that module's `SHARDING` lists its `AxisRules`, one per OnMesh
entry it writes. Three phases, one walk:

  `shard_local`   the traced graph, rewritten at local shapes into a new graph (tp: its
                  parameters are cut, so every later shape is a shard's)
  `shard`         the sharded graph, in place, innermost axis first (cp, then the batch axes
                  dp and dp_shard)
  `shard_chunks`  each chunk graph once the pipeline cut and the expert regions are known (ep)

For each axis the walk is the same, shared code:

  1. `prepare`: the axis's pre-rewrites (cp: ring attention, global positions), its context
  2. in graph order (live: nodes a redistribution inserts are walked in turn), each value's
     state on the axis: a placeholder's from `seed`; a call's from the axis's `decide` (its
     rule registry's decision): `Place(out)` records it (`Place(out, op)` also swaps the call
     for what this rank runs instead: cp's carried scan); `Gather(why)` brings the inputs to
     whole through the axis's one `redistribute` step and records a `Fallback`; `Refuse(why)`
     is the one-line PlanError built by `refusal`, unless the axis's `retry` rewrites what
     the refusal names (then what depends on the rewrite is walked again)
  3. `check_output` on the graph's outputs (a refusal as above)
  4. every value's state written as its placement on the axis (`placement.place_on`)
  5. `again`: whether to walk once more with what this walk learnt (tp: projections whose
     shards only reached fallbacks are kept whole), from a fresh `prepare`
  6. the notes: the axis's `summary`, then one line per fallback (`fallback_note`), which
     `inspect`, the start-up fallback line and `pm.program.notes` read.

In the local phase the axis writes a new graph: a decision is written by its `write` hook
(seed and outputs too), the old graph is only read, and `commit` puts the last walk's graph
into the program. A rule never touches the graph: only `prepare`, `write`, `redistribute` and
`retry` do, on the copy this pass owns. Adding an axis: its mesh entry (with `rules=`), its
plan field, its rules module (rules and one `AxisRules`), its runtime ops; nothing here or in
compiler/pipeline.py.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch.fx as fx

from threefold.errors import PlanError
from threefold.ir.contracts import stage_pass
from threefold.ir.program import tf
from threefold.ir.stages import Partitioned, Sharded, Traced, copy_graph_module
from threefold.ops.families import op_name
from threefold.ops.rules import Gather, Place, Refuse
from threefold.placement import place_on
from threefold.runtime import mesh as mesh_table

__all__ = ["AxisRules", "Fallback", "Gather", "Place", "Refuse", "axis_rules", "fallback_note", "settle",
           "shard", "shard_chunks", "shard_local", "walk"]


# -- what the walk records ---------------------------------------------------------------------

@dataclass(frozen=True)
class Fallback:
    """One op run on whole inputs: the one record every axis's fallbacks take."""
    axis: str
    op: str
    node: str
    module: str
    bytes_per_step: int    # moved per rank per step
    why: str               # what the op does that the axis cannot split
    how: str               # what the redistribution does
    detail: str = ""


def fallback_note(fb: Fallback) -> str:
    """The note a fallback leaves (`inspect`, threefold/fallbacks.py and pm.program.notes read it)."""
    return (f"{fb.axis} fallback: {fb.op} ({fb.node}) at {fb.module} {fb.why}: {fb.how}, {fb.bytes_per_step} "
            f"bytes per rank per step" + (f" ({fb.detail})" if fb.detail else ""))


@dataclass
class Walk:
    """One axis's walk over one graph: the values' states and what fell back."""
    rules: "AxisRules"
    gm: fx.GraphModule
    stage: object
    part: object = None    # the chunk whose graph this is (the chunk phase)
    ctx: object = None
    carry: object = None   # what the previous walk learnt (`again`), None on the first
    attempt: int = 0
    state: dict = field(default_factory=dict)
    fallbacks: list = field(default_factory=list)

    def refusal(self, node: fx.Node, why: str) -> str:
        """The one-line PlanError text for `node` on this axis."""
        r = self.rules
        return (f"{r.axis}={r.size(self.stage)}: {op_name(node)} at {tf(node).get('module') or '<top>'} {why}; "
                f"{r.fix}")


class AxisRules:
    """One axis's hooks for the walker (the defaults: nothing to do). Subclass per axis."""
    axis: str = ""                 # the OnMesh entry it writes
    phase: str = "graph"           # "local": rewrites the traced graph at local shapes; "graph": the
                                   # sharded graph, in place; "chunks": each chunk graph (after find_experts)
    fix: str = ""                  # what a refusal message tells the user to do

    def size(self, stage) -> int:
        return getattr(stage.plan, self.axis, 1)

    def active(self, stage) -> bool:
        return False

    def prepare(self, walk: Walk) -> None:
        """Pre-rewrites of the graph; set walk.ctx."""

    def seed(self, walk: Walk, node: fx.Node):
        """A placeholder's state."""
        return None

    def decide(self, walk: Walk, node: fx.Node):
        """The decision for one call (Place | Gather | Refuse); None: not on this axis."""
        return None

    def redistribute(self, walk: Walk, node: fx.Node, d: Gather, why: str):
        """Run `node` on whole inputs: (its state, [bytes moved per rank per step per input])."""
        raise PlanError(why)

    def fallback(self, walk: Walk, node: fx.Node, moved: int, why: str) -> Fallback:
        raise NotImplementedError

    def write(self, walk: Walk, node: fx.Node, d):
        """Local phase: write a decision (None: the call as it is) into the new graph; the
        output's state, or a `Gather` where its inputs cannot be brought as it needs."""
        raise NotImplementedError

    def write_output(self, walk: Walk, node: fx.Node) -> None:
        """Local phase: write the graph's outputs."""

    def again(self, walk: Walk, error: PlanError | None):
        """After a walk (or its refusal `error`): what the next walk should know (its `carry`),
        or None to stop (the refusal is raised)."""
        return None

    def commit(self, walk: Walk) -> None:
        """Local phase: put the last walk's graph and decisions into the program (walk.stage)."""

    def retry(self, walk: Walk, node: fx.Node, d: Refuse) -> list:
        """Rewrite what a refusal names so the call can be placed; the new nodes ([]: none)."""
        return []

    def check_output(self, walk: Walk, node: fx.Node) -> str | None:
        """Why the graph's outputs cannot leave this axis's states as they are (None: they can)."""
        return None

    def placement(self, s):
        """A state's placement on the axis (None: replicated, nothing written)."""
        return None

    def summary(self, walk: Walk) -> tuple:
        return ()


# -- the walk ----------------------------------------------------------------------------------

def walk(w: Walk) -> None:
    """Apply one axis's decisions to every value of w.gm (steps 2-4 above)."""
    r = w.rules
    for node in w.gm.graph.nodes:   # live: a redistribution's nodes, inserted after a node, are walked too
        if node.op == "placeholder":
            w.state[node] = r.seed(w, node)
        elif node.op == "output":
            why = r.check_output(w, node)
            if why:
                raise PlanError(w.refusal(node, why))
            r.write_output(w, node)
        elif node.op == "call_function":
            d = _apply(w, node)
            if isinstance(d, Refuse) and d.table is not None:
                moved = r.retry(w, node, d)
                if moved:
                    _again_after(w, moved, node)
                    d = _apply(w, node)
            if isinstance(d, Refuse):
                raise PlanError(w.refusal(node, d.why))
    for node in w.gm.graph.nodes:
        p = r.placement(w.state.get(node))
        if p is not None:
            place_on(node, r.axis, p)


def _apply(w: Walk, node: fx.Node):
    """One call's decision applied to the states (a Refuse is returned, not applied)."""
    d = w.rules.decide(w, node)
    if w.rules.phase == "local" and not isinstance(d, (Gather, Refuse)):
        out = w.rules.write(w, node, d)   # a new graph: the decision's nodes written there
        if not isinstance(out, Gather):
            w.state[node] = out
            return d
        d = out
    if d is None or isinstance(d, Place):
        if d is not None and d.op is not None:   # what this rank runs instead (cp: a scan's carry)
            node.target, node.args, node.kwargs = d.op.target, d.op.args, d.op.kwargs
        w.state[node] = d.out if d is not None else None
    elif isinstance(d, Gather):
        w.state[node], moved = w.rules.redistribute(w, node, d, w.refusal(node, d.why))
        w.fallbacks.extend(w.rules.fallback(w, node, b, d.why) for b in moved)
    return d


def _again_after(w: Walk, new: list, upto: fx.Node) -> None:
    """Decide again what depends on the `new` nodes, in order, up to (not including) `upto`."""
    seen, stack = set(), list(new)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.users)
    for x in upto.graph.nodes:   # live: a redistribution's nodes inserted on the way are walked too
        if x is upto:
            break
        if (x in seen or x not in w.state) and x.op == "call_function":
            d = _apply(w, x)
            if isinstance(d, Refuse):
                raise PlanError(w.refusal(x, d.why))


def settle(gm: fx.GraphModule, stage, rules: "AxisRules", part=None) -> Walk:
    """Walk until the axis's `again` has nothing more to learn; the last walk."""
    carry, attempt = None, 0
    while True:
        w = Walk(rules, gm, stage, part, carry=carry, attempt=attempt)
        rules.prepare(w)
        try:
            walk(w)
        except PlanError as exc:
            carry = rules.again(w, exc)
            if carry is None:
                raise
        else:
            carry = rules.again(w, None)
            if carry is None:
                return w
        attempt += 1


def _notes(w: Walk) -> tuple:
    return tuple(w.rules.summary(w)) + tuple(fallback_note(fb) for fb in w.fallbacks)


def _run(gm: fx.GraphModule, stage, rules: "AxisRules", part=None) -> tuple:
    return _notes(settle(gm, stage, rules, part))


# -- the axes, from the mesh's table -----------------------------------------------------------

def axis_rules(phase: str) -> list:
    """Every axis's AxisRules of `phase`, innermost mesh axis first (runtime/mesh.py AXES)."""
    out, seen = [], set()
    for a in reversed(mesh_table.AXES):
        if a.rules and a.rules not in seen:
            seen.add(a.rules)
            out += [r for r in importlib.import_module(a.rules).SHARDING if r.phase == phase]
    return out


@stage_pass(needs=Traced, gives=Sharded, guarantees=("placements",))
def shard_local(stage: Traced) -> Sharded:
    """Needs: a traced program. Guarantees: for each active axis of the local phase (tp), a
    new graph at local shapes with that axis's collectives, every op placed by a rule or run
    on whole inputs (a fallback note), the parameter cuts in prog.shard_fns. The input graph
    is only read."""
    active = [r for r in axis_rules("local") if r.active(stage)]
    if not active:
        return stage.advance(Sharded)
    prog = stage.draft(copy_graphs=False)
    for rules in active:
        w = settle(prog.gm, prog, rules)
        rules.commit(w)
        prog.notes.extend(_notes(w))
    return prog.freeze(Sharded)


@stage_pass(needs=Sharded, gives=Sharded)
def shard(stage: Sharded) -> Sharded:
    """Needs: the tp-sharded graph (traced at the local sequence length under cp). Guarantees:
    every value has its entry on each active axis of the graph phase (cp, dp, dp_shard), every
    op on those axes placed by a rule, run on whole inputs (a fallback note), or refused."""
    active = [r for r in axis_rules("graph") if r.active(stage)]
    if not active:
        return stage.evolve()
    gm = copy_graph_module(stage.gm)
    notes = ()
    for rules in active:
        notes += _run(gm, stage, rules)
    gm.graph.lint()
    gm.recompile()
    return stage.evolve(gm=gm, notes=stage.notes + notes)


@stage_pass(needs=Partitioned)
def shard_chunks(prog: Partitioned) -> Partitioned:
    """Needs: chunk graphs with their expert regions (passes/experts.py). Guarantees: every
    value has its entry on each active axis of the chunk phase (ep)."""
    active = [r for r in axis_rules("chunks") if r.active(prog)]
    if not active:
        return prog.evolve()
    chunks, notes = [], ()
    for chunk in prog.chunks:
        gm = copy_graph_module(chunk.gm)
        for rules in active:
            notes += _run(gm, prog, rules, chunk)
        chunks.append(chunk.evolve(gm=gm))
    return prog.evolve(chunks=tuple(chunks), **({"notes": prog.notes + notes} if notes else {}))
