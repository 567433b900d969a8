"""One walk's tensor-parallel rewrite at local shapes: the walker's context for tp.

`_Rewriter` holds what tp has decided so far in one walk of passes/shard.py's local phase
(each value's placement and local value, the parameter cuts, the weights kept whole, the
parameters applied to shards or whole) and writes the new graph: `decision` gives the
decision for a call (tp_weights, tp_einsum, tp_pieces for matmuls with a parameter, the
rule registry for everything else), `apply` writes one (cuts checked, inputs brought by one
redistribution step, the op and its follow-ups emitted), `commit` puts the last walk into
the program. The collectives it inserts are CollectiveEmitter's (tp_collectives.py); the
hooks that drive it are tensor_parallel.TensorParallel's.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from threefold import placement
from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ops.families import args_of
from threefold.ops.rules import RESULT, NoRule as NoRuleDecision, Op
from threefold.passes.cost import op_name
from threefold.passes.shard import Gather
from threefold.passes.tp_collectives import CollectiveEmitter
from threefold.passes.tp_decisions import REDUCE, REGISTRY, ReduceScatter, TpCall, TpDecision
from threefold.passes.tp_einsum import einsum_matmul, einsum_param
from threefold.passes.tp_padding import padded_size, padding_ok, padding_safe
from threefold.passes.tp_pieces import piece_matmul, weight_piece
from threefold.passes.tp_patterns import _is_param, _param_weight
from threefold.passes.tp_placement import R, Partial, Replicate, Shard, to_meta
from threefold.passes.tp_redistribute import NoRule, redistribute
from threefold.passes import tp_rules  # noqa: F401  (registers the rules on REGISTRY)
from threefold.passes.tp_report import tp_report
from threefold.passes.tp_weights import embedding, weight_matmul
from threefold.runtime import tp_ops
from threefold.runtime.shard import ShardSpec
from threefold.runtime.tp_ops import TP

aten = torch.ops.aten

__all__ = ["_Rewriter"]


def _place(node: fx.Node, place) -> None:
    """Record a value's tp placement: its entry in node.meta["on_mesh"] (one placement per
    mesh axis, threefold/placement.OnMesh) and, for the readers of the tp axis alone, tf."""
    tf(node)["placement"] = placement.of(place)
    node.meta["on_mesh"] = (node.meta.get("on_mesh") or placement.OnMesh()).with_axis("tp", place)


class _Rewriter(CollectiveEmitter):
    """One walk's rewrite of the graph at local shapes (the walker's `ctx` for tp): what has
    been decided so far (placements, local values, parameter cuts), the decision for a call
    (`decision`), the new graph written from decisions (`apply`, emit/copy_node), the
    parameter cuts recorded (decide/param_arg); the collectives it inserts are
    CollectiveEmitter's (tp_collectives.py)."""
    def __init__(self, prog, avoid: dict[str, str] | None = None):   # prog: a Draft of the Traced stage
        self.prog = prog
        self.avoid = dict(avoid or {})          # weights to keep replicated (see tensor_parallel)
        self.fallbacks: list = []               # ops run on gathered inputs: shard.Fallback records (tp_redistribute)
        self.fallback_blocked: list[list[str]] = []   # per fallback: the column weights whose shards reached it
        self.blamed: dict[str, str] = {}        # column weights whose shards hit a fallback -> where
        self.origin: dict[fx.Node, frozenset] = {}     # sharded value -> column weights it came from
        self.f_source: dict[fx.Node, fx.Node] = {}     # f(x) -> x
        self.gathered_from: dict[fx.Node, fx.Node] = {}  # all_gather_seq(x) -> x
        self.notes: list[str] = []
        self.replicated_weights: dict[str, str] = {}   # fqn -> why it is kept whole
        self.padded: dict[str, str] = {}               # fqn -> its padding (tp_padding.py)
        self.whole_blocks: dict[str, tuple[bool, ...]] = {}   # fqn -> blocks every rank holds whole
        self.padded_len: dict[fx.Node, int] = {}       # padded sequence shards emitted here -> true length
        self.maybe_dead: list[fx.Node] = []
        self.old_of: dict[fx.Node, fx.Node] = {}        # new node -> the source node it stands for
        self._grad_memo: dict[fx.Node, bool] = {}
        self.t = prog.plan.tp
        self.sp = prog.plan.sp
        self.old = prog.graph
        self.new = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.place: dict[fx.Node, object] = {}
        self.val: dict[fx.Node, object] = {}
        self.decisions: dict[str, tuple[int, tuple[int, ...], int]] = {}  # fqn -> (dim, blocks, padded)
        self.param_nodes: dict[str, fx.Node] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.user_derived: set[fx.Node] = set()
        self.shard_uses: set[str] = set()      # R params applied to shards (grad sum over tp)
        self.replicated_uses: set[str] = set()
        self.whole_sites: list[tuple] = []     # (call, input, its params) applying R params to whole values
        self.unsited: set[str] = set()         # R params applied whole where no input names the use
        self.current: fx.Node | None = None
        self._sources_memo: dict[fx.Node, frozenset | None] = {}

    # ---- what the walker's hooks call --------------------------------------------------
    def placeholder(self, old: fx.Node):
        new = self.new.placeholder(old.name)
        new.meta = dict(old.meta)
        new.meta["tf"] = dict(tf(old))
        new.meta["on_mesh"] = placement.on_mesh_of(old).with_axis("tp", R)
        self.env[old] = new
        self.old_of[new] = old
        self.place[new] = R
        self.val[new] = to_meta(old.meta.get("val"))
        if tf(old).get("kind") == "param":
            self.param_nodes[tf(old)["fqn"]] = new
        if tf(old).get("kind") == "input":
            self.user_derived.add(old)
        return R

    def bind(self, old: fx.Node, new: fx.Node, mark: int):
        """`new` stands for `old` from now on; the placement it has (the walk's state)."""
        # keep the source graph's value names (generated code reads like the model)
        if new.name != old.name and new in list(self.new.nodes)[mark:]:
            new._rename(old.name)
        self.env[old] = new
        self.old_of.setdefault(new, old)
        return self.place[new]

    def _finish(self) -> None:
        for node in reversed(self.maybe_dead):   # transposes of parameters re-emitted per matmul
            if not node.users:
                self.new.erase_node(node)
        for fqn, (dim, blocks, pad) in self.decisions.items():
            node = self.param_nodes[fqn]
            node.meta["val"] = self._param_local(fqn)
            _place(node, Shard(dim, blocks))
        self._share_whole_uses(self.shard_uses & self.replicated_uses)

    def _share_whole_uses(self, both: set) -> None:
        """Parameters applied both to shards and to whole values (RWKV's time mix under sp:
        `x * mix + shifted * (1 - mix)`, one operand a sequence shard): the runtime sums their
        gradient over tp (tp_grad_sync), which counts a whole use's gradient, the same on
        every rank, t times. Each whole use reads them through `tp_ops.grad_share` (backward
        divides by t: exact for t a power of two), so the sum counts it once."""
        if not both:
            return
        sites = {(o, a) for o, a, src in self.whole_sites if src & both}
        stray = both & self.unsited | {f for o, a, src in self.whole_sites if src & both for f in src - both}
        if stray:
            raise PlanError(f"parameter {sorted(stray)[0]} is applied both to sharded and to replicated "
                            f"activations under tp={self.t}; threefold cannot split its gradient")
        for o, a in sorted(sites, key=lambda s: (s[0].name, s[1].name)):
            use, value = self.env[o], self.env[a]
            if value not in use.all_input_nodes:
                raise PlanError(f"parameter {sorted(both)[0]} is applied both to sharded and to replicated "
                                f"activations under tp={self.t}; threefold cannot split its gradient")
            with self.new.inserting_before(use):
                shared = self.emit(tp_ops.grad_share, (value, TP), place=self.place[value], val=self.val[value],
                                   src=o)
            use.replace_input_with(value, shared)
        note = f"tp: {', '.join(sorted(both))} applied to shards and to whole values: the whole uses' " \
               f"gradients enter the sum over tp divided by {self.t}"
        self.notes.append(note)

    def commit(self) -> None:
        """Write this rewrite into the program (the last of the retries)."""
        prog = self.prog
        prog.shard_fns = {}
        for fqn, (dim, blocks, pad) in self.decisions.items():
            prog.shard_fns[fqn] = ShardSpec(dim, blocks, pad, self.t, self.whole_blocks.get(fqn, ()))
        prog.tp_grad_sync = sorted(self.shard_uses - set(self.decisions))
        gm = fx.GraphModule(prog.gm, self.new)
        for node in gm.graph.nodes:
            if node.op == "call_function" and not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
                if node.users:
                    raise AssertionError(f"tensor parallel pass left {node.name} without a shape")
        prog.gm = gm
        prog.tp_report = tp_report(self)

    # ---- emitting --------------------------------------------------------------------
    def emit(self, target, args, kwargs=None, place=R, val=None, src: fx.Node | None = None,
             collective: dict | None = None) -> fx.Node:
        kwargs = kwargs or {}
        node = self.new.call_function(target, tuple(args), dict(kwargs))
        if val is None:
            val = self._meta_eval(target, args, kwargs)
        node.meta["val"] = val
        src = src or self.current
        if src is not None:
            node.meta["nn_module_stack"] = src.meta.get("nn_module_stack", {})
            node.meta["tf"] = {k: v for k, v in tf(src).items() if k in ("module",)}
        _place(node, place)
        if collective:
            tf(node)["collective"] = collective
        self.place[node] = place
        self.val[node] = val
        if isinstance(place, (Shard, list)):
            src_origins = [self.origin[a] for a in node.all_input_nodes if a in self.origin]
            if src_origins:
                self.origin[node] = frozenset().union(*src_origins)
        return node

    def _meta_eval(self, target, args, kwargs):
        def conv(a):
            if isinstance(a, fx.Node):
                return self.val[a]
            if isinstance(a, torch.device):
                return torch.device("meta")
            return a
        try:
            return to_meta(target(*tree_map(conv, tuple(args)), **tree_map(conv, dict(kwargs))))
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(f"tp={self.t}: {self._where()} cannot run on local shapes "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None

    def _where(self, node: fx.Node | None = None) -> str:
        node = node or self.current
        fqn = tf(node).get("module", "") if node is not None else ""
        return f"op {op_name(node)} ({node.name}) in module {fqn or '<top>'}" if node is not None else "graph"

    def copy_node(self, old: fx.Node, args=None, kwargs=None, place=R, val=None) -> fx.Node:
        args = self._map(old.args) if args is None else args
        kwargs = self._map(old.kwargs) if kwargs is None else kwargs
        return self.emit(old.target, args, kwargs, place, val)

    def _map(self, a):
        return fx.node.map_arg(a, lambda n: self.env[n])


    # ---- parameters ------------------------------------------------------------------
    def decide(self, fqn: str, dim: int, blocks: tuple[int, ...], pad: int) -> None:
        want = (dim, blocks, pad)
        if fqn in self.replicated_uses:
            raise PlanError(f"parameter {fqn} (tied or reused) is used whole and would also be split "
                            f"under tp={self.t}; untie it or keep tp=1 for it")
        have = self.decisions.get(fqn)
        if have is not None and have != want:
            raise NoRule(f"parameter {fqn} (tied or reused) would be split two ways under tp={self.t} "
                            f"({have} and {want}); untie it or keep tp=1 for it")
        self.decisions[fqn] = want
        node = self.param_nodes[fqn]   # later readers other than its matmul see it as a shard
        self.place[node] = Shard(dim, blocks)
        self.val[node] = self._param_local(fqn)

    def _param_local(self, fqn: str):
        dim, blocks, pad = self.decisions[fqn]
        full = self.prog.state[fqn]
        shape = list(full.shape)
        whole = self.whole_blocks.get(fqn) or (False,) * len(blocks)
        shape[dim] = sum(b if w else b // self.t for b, w in zip(blocks, whole)) if blocks else pad // self.t
        return torch.empty(shape, dtype=full.dtype, device="meta")

    def param_arg(self, old_arg: fx.Node) -> fx.Node:
        new = self.env[old_arg]
        fqn = tf(old_arg).get("fqn")
        if fqn in self.decisions:
            self.val[new] = self._param_local(fqn)
        return new

    # ---- deciding ----------------------------------------------------------------------
    def decision(self, old: fx.Node):
        """The decision for `old` on the inputs as placed now: None (the call as it is), a
        TpDecision, or Gather(why). Reads this rewrite's state; writes nothing but the
        parameters a weight piece's linear applies whole. A weight matmul that cannot be
        split raises NoRule (the walker's hook gathers)."""
        name = op_name(old)
        weight = _param_weight(old, name)
        if weight is not None:
            return weight_matmul(self, old, name, *weight)
        if name == "einsum" and einsum_param(old) is not None:
            return einsum_matmul(self, old)
        if name == "linear" and weight_piece(old.args[1]) is not None:
            d = piece_matmul(self, old)
            if d is not None:
                return d
            split, param, _ = weight_piece(old.args[1])
            self.replicated_uses.add(tf(param)["fqn"])
            self.unsited.add(tf(param)["fqn"])
        if name == "embedding" and _is_param(old.args[0]) and old.args[1] in self.user_derived \
                and tf(old.args[0])["fqn"] not in self.avoid:
            return embedding(self, old)
        inputs = [self.env[a] for a in old.all_input_nodes]
        if all(isinstance(self.place[i], Replicate) and not self.place[i].gathered
               and not self.place[i].partial_grad for i in inputs):
            return None
        padded_dims = {self.place[i].dim for i in inputs if self.seq_len(i, getattr(self.place[i], "dim", -1))}
        if padded_dims and not padding_safe(name, old, padded_dims):
            return Gather(f"{name} reads a sequence shard padded for tp={self.t} across its rows")
        heads_padded = {a: size for a in old.all_input_nodes if (size := padded_size(self, a))}
        if heads_padded and not padding_ok(self, old, heads_padded):
            return Gather(f"{name} mixes the entries of a dim padded for tp={self.t}")
        decision = REGISTRY.decide(name, old, self._call(old, name))
        if decision is None:
            return Gather("no sharded rule for " + name + " on inputs placed "
                          + ", ".join(str(self.place[i]) for i in inputs))
        if isinstance(decision, NoRuleDecision):
            return Gather(f"{self._where()} {decision.why}; use tp=1 for this model or restructure it")
        return decision

    def _call(self, old: fx.Node, name: str) -> TpCall:
        """What a rule sees of `old`: its arguments by name, its inputs' placements and local values."""
        ins = old.all_input_nodes
        return TpCall(old, name, args_of(old), self.t, {a: self.place[self.env[a]] for a in ins},
                      {a: self.val[self.env[a]] for a in ins})

    def apply(self, old: fx.Node, d: TpDecision) -> fx.Node:
        """Write a decision: the parameter cuts it needs (NoRule where a tied weight is
        already cut another way), its inputs brought to the placements it needs (one
        redistribution step, tp_redistribute), the op (or its substitute) and its
        follow-ups, then what it tells (kept weights, padding notes, shard origins)."""
        for cut in d.cuts:
            if cut.whole:
                self.whole_blocks[cut.fqn] = cut.whole
            self.decide(cut.fqn, cut.dim, cut.blocks, cut.pad)
        arrived: dict[fx.Node, fx.Node] = {}

        def arrive(a: fx.Node) -> fx.Node:
            if a not in arrived:
                arrived[a] = redistribute(self, self.env[a], d.needs.get(a), a)
            return arrived[a]
        for a in d.first:
            arrive(a)
        if d.same_as is not None:
            return arrive(d.same_as)
        op = d.op or Op(old.target, old.args, old.kwargs)
        new = self._emit_op(op, d.out if op.place is None else op.place, arrive, None)
        for step in d.then:
            if step == REDUCE:
                new = self.g(new)
            elif isinstance(step, ReduceScatter):
                new = self.reduce_scatter(new, step.dim)
            else:
                new = self._emit_op(step, step.place or d.out, arrive, new)
        if d.uses:
            self._note_param_uses(old, sharded=d.uses == "sharded", skip=d.skip)
        for fqn, why in d.kept:
            self.replicated_weights[fqn] = why
        self.replicated_uses |= d.whole_uses
        self.unsited |= d.whole_uses
        for fqn, how in d.padded:
            self.padded.setdefault(fqn, how)
        self.notes.extend(n for n in d.notes if n not in self.notes)
        if d.origin is not None:
            self.origin[new] = d.origin
        if d.seq_len is not None:
            self.padded_len[new] = d.seq_len
        return new

    def _emit_op(self, op: Op, place, arrive, prev) -> fx.Node:
        args = tuple(prev if a is RESULT else a for a in fx.node.map_arg(op.args, arrive))
        node = self.emit(op.target, args, fx.node.map_arg(op.kwargs, arrive), place=place, val=op.val,
                         collective=op.collective)
        if op.name:
            node._rename(op.name)
        return node

    def _rollback(self, mark: int, decided: dict | None = None) -> None:
        """Erase what a failed rule emitted (newest first) and forget it in the caches."""
        if decided is not None:
            for fqn in set(self.decisions) - set(decided):
                node = self.param_nodes[fqn]
                self.place[node] = R
                self.val[node] = to_meta(self.prog.state[fqn])
            self.decisions = decided
        created = list(self.new.nodes)[mark:]
        gone = set(created)
        for node in reversed(created):
            self.new.erase_node(node)
        self.cache = {k: v for k, v in self.cache.items() if v not in gone}

    def _note_param_uses(self, old: fx.Node, sharded: bool, skip: set = frozenset()) -> None:
        """Record replicated parameters (or values made from them alone, like Gemma's
        1 + weight) that this op applies to activations. Applied to shards, each rank
        holds only part of their gradient, which the runtime then sums over tp."""
        sources = [self._param_sources(a) for a in old.all_input_nodes]
        if all(src is not None for src in sources):
            return  # parameters transformed among themselves: not a use yet
        for a, src in zip(old.all_input_nodes, sources):
            if a in skip:
                continue
            src = frozenset(f for f in src or () if f not in self.decisions)
            (self.shard_uses if sharded else self.replicated_uses).update(src)
            if src and not sharded:
                self.whole_sites.append((old, a, src))

    def _param_sources(self, old: fx.Node) -> frozenset | None:
        """The parameters a value is computed from, if it depends on nothing else
        (buffers and constants allowed); None for activations."""
        memo = self._sources_memo
        if old in memo:
            return memo[old]
        if old.op == "placeholder":
            kind = tf(old).get("kind")
            out = frozenset([tf(old)["fqn"]]) if kind == "param" else frozenset() if kind == "buffer" else None
        else:
            out = frozenset()
            for a in old.all_input_nodes:
                src = self._param_sources(a)
                if src is None:
                    out = None
                    break
                out |= src
        memo[old] = out
        return out


    def _output(self, old: fx.Node) -> None:
        outs = []
        for o in old.args[0]:
            n = self.env[o] if isinstance(o, fx.Node) else o
            if isinstance(n, fx.Node):
                p = self.place[n]
                if isinstance(p, Partial):
                    n = self.g(n)
                elif isinstance(p, Shard):
                    n = self.gather(n, p.dim)
                    full = o.meta["val"]
                    if tuple(self.val[n].shape) != tuple(full.shape):  # vocabulary padding
                        n = self.emit(aten.slice.Tensor, (n, p.dim, 0, full.shape[p.dim]), place=R)
            outs.append(n)
        self.new.output(tuple(outs))


