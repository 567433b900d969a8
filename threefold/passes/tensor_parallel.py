"""Megatron tensor parallelism derived from an unmodified ATen graph.

Every value gets a placement (tp_placement.py): Replicate, Partial or Shard(dim). We walk
the graph once in order, writing a new graph of *local* (per-tp-rank) shapes:

* A matmul with a parameter weight (aten.linear, GPT-2's addmm with an [in, out] Conv1D
  weight, mm/matmul) whose input is replicated becomes column-parallel: its weight is split
  on the output features, the input passes through f (identity forward, all-reduce
  backward; one f per input value, shared by q/k/v or gate/up). If its output feeds a
  split (a fused QKV), the weight is split block-wise so each rank gets its own q, k, v.
* A weight matmul whose input is sharded on the contracted dim becomes row-parallel: its
  output is Partial and is reduced at once by g (all-reduce forward, identity backward),
  or under sequence parallelism by a reduce-scatter; the bias is added after.
* Everything in between follows per-op rules in RULES (tp_rules.py: elementwise, views and
  reshapes by dimension maps (tp_dims.py), splits and slices of block-strided dims, attention
  matmuls, softmax, norms ...). Where no rule applies, the op runs on gathered inputs
  (tp_redistribute.py), recorded in prog.tp_report and a PlanError under strict=true.
* A column-parallel projection whose shards reach such an op is instead kept whole (the
  pass reruns with it replicated): Megatron's pairing, column then row, is only used where
  it pays. One whose heads or output features tp does not divide is padded to whole heads
  (tp_padding.py); a fused projection read as slices is one linear per piece, and a piece
  that cannot be split (one k/v head) is kept whole beside its sharded siblings
  (tp_fused_split.py, tp_pieces.py).
* `x @ W.T` (matmul of a transposed 2-D parameter) is a weight matmul like aten.linear.
* An embedding indexed by user input (token ids) is vocab-parallel; a cross-entropy over
  vocab-sharded logits becomes the vocab-parallel cross-entropy. Vocabularies t does not
  divide are padded (padding never wins the softmax and gets no gradient).
* Sequence parallelism (plan.sp): replicated activations of [batch, seq, hidden] are kept
  as sequence shards; all-gather before column-parallel matmuls, reduce-scatter after
  row-parallel ones; parameters applied to shards get their gradients summed over tp.
Weights are cut from the full model's tensors by prog.shard_fns, so tp=1 and tp=t start
identical.
"""
from __future__ import annotations


import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from threefold.compiler.cost import op_name
from threefold.compiler.contracts import stage_pass
from threefold.compiler.program import tf
from threefold.compiler.stages import Sharded, Traced
from threefold import placement
from threefold.errors import PlanError
from threefold.passes.tp_placement import (P, R, Partial, Replicate, Shard, local_size, padded)
from threefold.passes.tp_patterns import (_GROUPED, _TRANSPOSES, _coll, _feeds_cross_entropy, _head_count,
                                          _is_param, _needs_grad, _param_weight, _replace, _split_blocks,
                                          x_old_of)
from threefold.passes.tp_einsum import einsum_matmul, einsum_param
from threefold.passes.tp_fused_split import fused_cuts, split_fused_outputs
from threefold.passes.tp_padding import padded_size, padding_ok
from threefold.passes.tp_pieces import piece_matmul, weight_piece
from threefold.passes.tp_redistribute import NoRule, fallback, replicated
from threefold.runtime import tp_ops
from threefold.runtime.shard import ShardSpec
from threefold.runtime.tp_ops import TP

aten = torch.ops.aten


@stage_pass(needs=Traced, gives=Sharded, guarantees=("placements",))
def tensor_parallel(stage: Traced) -> Sharded:
    """Needs: a traced program. Guarantees: for tp>1, local shapes, TP collectives inserted,
    shard_fns for every sharded parameter, tp_grad_sync for shard-applied ones,
    tp_report (sharded share, fallbacks); every op on inputs of the right layout.
    The input graph is only read: the rewrite writes a new graph."""
    if stage.plan.tp == 1:
        return stage.advance(Sharded)
    # a fused projection cut into pieces by slices (Falcon's multi-query qkv) becomes one
    # linear per piece of its weight, on a copy of the graph (tp_fused_split.py)
    fused = fused_cuts(stage.gm.graph, stage.state)
    prog = stage.draft(copy_graphs=bool(fused))
    if fused:
        split_fused_outputs(prog.gm.graph, prog.state)
        prog.gm.recompile()
    prog.shard_fns, prog.tp_grad_sync, prog.notes = {}, [], list(stage.notes)
    # Megatron's pairing: a column-parallel matmul pays off only if its shards reach a
    # row-parallel matmul (or another sharded consumer). When its shards run into an op with
    # no sharded rule, rewrite with that projection replicated instead of gathering them.
    avoid: dict[str, str] = {}   # fqn -> the op its shards could not pass
    for attempt in range(_MAX_RETRIES):
        rw = _Rewriter(prog, avoid)
        try:
            rw.run()
        except PlanError as exc:
            # padded heads/features (tp_padding.py) whose shards no rule could follow: keep
            # those projections whole, as before padding existed
            if not rw.padded or prog.plan.strict or attempt == _MAX_RETRIES - 1:
                raise
            why = str(exc).splitlines()[0][:160]
            avoid.update({fqn: f"its padded shards could not be followed ({why})" for fqn in rw.padded})
            continue
        more = {fqn: why for fqn, why in rw.blamed.items() if fqn not in avoid}
        if not more or prog.plan.strict:
            break
        avoid.update(more)
    rw.commit()
    return prog.freeze(Sharded)


_MAX_RETRIES = 8


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    return v


class _Rewriter:
    def __init__(self, prog, avoid: dict[str, str] | None = None):   # prog: a Draft of the Traced stage
        self.prog = prog
        self.avoid = dict(avoid or {})          # weights to keep replicated (see tensor_parallel)
        self.fallbacks: list[dict] = []         # ops run on gathered inputs (tp_redistribute)
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
        self.current: fx.Node | None = None
        self._sources_memo: dict[fx.Node, frozenset | None] = {}

    # ---- driver ----------------------------------------------------------------------
    def run(self) -> None:
        for old in self.old.nodes:
            self.current = old
            if old.op == "placeholder":
                new = self.new.placeholder(old.name)
                new.meta = dict(old.meta)
                new.meta["tf"] = dict(tf(old))
                self.env[old] = new
                self.old_of[new] = old
                self.place[new] = R
                self.val[new] = _to_meta(old.meta.get("val"))
                if tf(old).get("kind") == "param":
                    self.param_nodes[tf(old)["fqn"]] = new
                if tf(old).get("kind") == "input":
                    self.user_derived.add(old)
            elif old.op == "output":
                self._output(old)
            else:
                if any(a in self.user_derived for a in old.all_input_nodes):
                    self.user_derived.add(old)
                before = len(self.new.nodes)
                new = self._visit(old)
                # keep the source graph's value names (generated code reads like the model)
                created = list(self.new.nodes)[before:]
                if new in created and new.name != old.name:
                    new._rename(old.name)
                self.env[old] = new
                self.old_of.setdefault(new, old)
        self._finish()

    def _finish(self) -> None:
        for node in reversed(self.maybe_dead):   # transposes of parameters re-emitted per matmul
            if not node.users:
                self.new.erase_node(node)
        for fqn, (dim, blocks, pad) in self.decisions.items():
            node = self.param_nodes[fqn]
            node.meta["val"] = self._param_local(fqn)
            tf(node)["placement"] = Shard(dim, blocks)
        both = self.shard_uses & self.replicated_uses
        if both:
            raise PlanError(f"parameter {sorted(both)[0]} is applied both to sharded and to replicated "
                            f"activations under tp={self.t}; threefold cannot split its gradient")

    def commit(self) -> None:
        """Write this rewrite into the program (the last of the retries)."""
        prog = self.prog
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
        prog.notes.extend(self.notes)
        prog.notes.extend(report_notes(prog.tp_report))

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
        tf(node)["placement"] = placement.of(place)
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
            return _to_meta(target(*tree_map(conv, tuple(args)), **tree_map(conv, dict(kwargs))))
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

    # ---- redistribution --------------------------------------------------------------
    def f(self, x: fx.Node) -> fx.Node:
        def make():
            node = self.emit(tp_ops.f, (x, TP), place=Replicate(partial_grad=True), val=self.val[x],
                             collective=_coll("all_reduce", "backward", self.val[x]))
            self.f_source[node] = x
            return node
        return self._cached(("f", x), make)

    def g(self, x: fx.Node) -> fx.Node:
        return self.emit(tp_ops.g, (x, TP), place=R, val=self.val[x],
                         collective=_coll("all_reduce", "forward", self.val[x]))

    def reduce_scatter(self, x: fx.Node, dim: int) -> fx.Node:
        v = self.val[x]
        shape = list(v.shape)
        shape[dim], extra = self.seq_shard(shape[dim])
        out = torch.empty(shape, dtype=v.dtype, device="meta")
        node = self.emit(tp_ops.reduce_scatter, (x, dim, TP, *extra), place=Shard(dim, seq=True), val=out,
                         collective=_coll("reduce_scatter", "forward", v, back="all_gather"))
        if extra:
            self.padded_len[node] = extra[0]
        return node

    def seq_shard(self, size: int) -> tuple[int, tuple]:
        """A sequence shard's local length, and the extra `size` argument of the collective
        when tp does not divide the length: then every rank holds ceil(size/t) rows, the
        last rank's tail padding (runtime/tp_ops._pad), and gathers cut it off."""
        if size % self.t == 0:
            return size // self.t, ()
        note = f"sequence length {size} padded to {padded(size, self.t)} for tp={self.t} (sp)"
        if note not in self.notes:
            self.notes.append(note)
        return padded(size, self.t) // self.t, (size,)

    def seq_len(self, x: fx.Node, dim: int) -> int | None:
        """The true length of sequence shard `x` along `dim` when its shards are padded."""
        p = self.place.get(x)
        if not (isinstance(p, Shard) and p.seq and p.dim == dim):
            return None
        old = self.old_of.get(x)
        v = old.meta.get("val") if old is not None else None
        if x in self.padded_len:
            return self.padded_len[x]
        if isinstance(v, torch.Tensor) and dim < v.dim() and v.shape[dim] % self.t:
            return int(v.shape[dim])
        return None

    def gather_seq(self, x: fx.Node, dim: int) -> fx.Node:
        def make():
            v = self.val[x]
            shape = list(v.shape)
            size = self.seq_len(x, dim)
            shape[dim] = size or shape[dim] * self.t
            out = torch.empty(shape, dtype=v.dtype, device="meta")
            extra = (size,) if size else ()
            node = self.emit(tp_ops.all_gather_seq, (x, dim, TP, *extra), place=Replicate(gathered=True), val=out,
                             collective=_coll("all_gather", "forward", out, back="reduce_scatter",
                                              regathers=True))
            self.gathered_from[node] = x
            return node
        return self._cached(("ag", x, dim), make)

    def scatter(self, x: fx.Node, dim: int, seq: bool = False) -> fx.Node:
        def make():
            v = self.val[x]
            shape = list(v.shape)
            extra = ()
            if seq:
                shape[dim], extra = self.seq_shard(shape[dim])
            else:
                shape[dim] = local_size(shape[dim], self.t, f"{self._where()} (dim {dim} of {list(v.shape)})")
            out = torch.empty(shape, dtype=v.dtype, device="meta")
            node = self.emit(tp_ops.scatter, (x, dim, TP, *extra), place=Shard(dim, seq=seq), val=out,
                             collective=_coll("all_gather", "backward", v) if _needs_grad(v) else None)
            if extra:
                self.padded_len[node] = extra[0]
            return node
        return self._cached(("scatter", x, dim), make)

    def gather(self, x: fx.Node, dim: int, blocks: tuple[int, ...] = ()) -> fx.Node:
        """All-gather a shard (block by block for a block-strided dim); backward slices."""
        def make():
            v = self.val[x]
            shape = list(v.shape)
            shape[dim] = sum(blocks) if blocks else shape[dim] * self.t
            out = torch.empty(shape, dtype=v.dtype, device="meta")
            target, args = (tp_ops.gather_blocks, (x, dim, list(blocks), TP)) if blocks else (tp_ops.gather, (x, dim, TP))
            return self.emit(target, args, place=R, val=out, collective=_coll("all_gather", "forward", out))
        return self._cached(("gather", x, dim, tuple(blocks)), make)

    def scatter_blocks(self, x: fx.Node, dim: int, blocks: tuple[int, ...]) -> fx.Node:
        def make():
            v = self.val[x]
            shape = list(v.shape)
            shape[dim] = sum(local_size(b, self.t, f"{self._where()} (block of {b})") for b in blocks)
            out = torch.empty(shape, dtype=v.dtype, device="meta")
            return self.emit(tp_ops.scatter_blocks, (x, dim, list(blocks), TP), place=Shard(dim, tuple(blocks)),
                             val=out, collective=_coll("all_gather", "backward", v) if _needs_grad(v) else None)
        return self._cached(("scatter_blocks", x, dim, tuple(blocks)), make)

    def scatter_like(self, x: fx.Node, dim: int, like: Shard) -> fx.Node:
        """A replicated value cut on `dim` the way `like` is laid out (blocks included)."""
        if like.blocks:
            return self.scatter_blocks(x, dim, like.blocks)
        return self.scatter(x, dim, like.seq)

    def has_grad(self, old: fx.Node) -> bool:
        """Whether a source value depends on a trainable parameter."""
        memo = self._grad_memo
        if old not in memo:
            if old.op == "placeholder":
                memo[old] = tf(old).get("kind") == "param" and not tf(old).get("frozen", False)
            else:
                memo[old] = any(self.has_grad(a) for a in old.all_input_nodes)
        return memo[old]

    def _cached(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def to_replicated(self, x: fx.Node) -> fx.Node:
        p = self.place[x]
        if isinstance(p, Replicate):
            return x
        if isinstance(p, Partial):
            return self.g(x)
        if isinstance(p, Shard) and p.seq:
            return self.gather_seq(x, p.dim)
        return replicated(self, x)[0]

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

    # ---- visiting --------------------------------------------------------------------
    def _visit(self, old: fx.Node) -> fx.Node:
        name = op_name(old)
        weight = _param_weight(old, name)
        if weight is not None:
            mark, decided = len(self.new.nodes), dict(self.decisions)
            try:
                return self.weight_matmul(old, name, *weight)
            except NoRule as exc:   # e.g. a reused weight already split another way
                self._rollback(mark, decided)
                return fallback(self, old, str(exc).split(": ", 1)[-1])
        if name == "einsum" and einsum_param(old) is not None:
            mark, decided = len(self.new.nodes), dict(self.decisions)
            try:
                return einsum_matmul(self, old)
            except NoRule as exc:
                self._rollback(mark, decided)
                return fallback(self, old, str(exc).split(": ", 1)[-1])
        if name == "linear" and weight_piece(old.args[1]) is not None:
            out = piece_matmul(self, old)
            if out is not None:
                return out
            split, param, _ = weight_piece(old.args[1])
            self.replicated_uses.add(tf(param)["fqn"])
        if name == "embedding" and _is_param(old.args[0]) and old.args[1] in self.user_derived \
                and tf(old.args[0])["fqn"] not in self.avoid:
            return self.embedding(old)
        inputs = [self.env[a] for a in old.all_input_nodes]
        if all(isinstance(self.place[i], Replicate) and not self.place[i].gathered
               and not self.place[i].partial_grad for i in inputs):
            self._note_param_uses(old, sharded=False)
            return self.copy_node(old, val=_to_meta(old.meta.get("val")))
        padded_dims = {self.place[i].dim for i in inputs if self.seq_len(i, getattr(self.place[i], "dim", -1))}
        if padded_dims and not padding_safe(name, old, padded_dims):
            return fallback(self, old, f"{name} reads a sequence shard padded for tp={self.t} across its rows")
        heads_padded = {a: size for a in old.all_input_nodes if (size := padded_size(self, a))}
        if heads_padded and not padding_ok(self, old, heads_padded):
            return fallback(self, old, f"{name} mixes the entries of a dim padded for tp={self.t}")
        rule = RULES.get(name) or (RULES.get(name[:-1]) if name.endswith("_") and name[:-1] in _IN_PLACE_OK else None)
        if rule is None:
            return fallback(self, old, "no sharded rule for " + name + " on inputs placed "
                            + ", ".join(str(self.place[i]) for i in inputs))
        mark = len(self.new.nodes)
        uses = (set(self.shard_uses), set(self.replicated_uses))
        try:
            return rule(self, old)
        except NoRule as exc:
            self._rollback(mark)
            self.shard_uses, self.replicated_uses = uses
            return fallback(self, old, str(exc).split(": ", 1)[-1])

    def _rollback(self, mark: int, decided: dict | None = None) -> None:
        """Erase what a failed rule emitted (newest first) and forget it in the caches."""
        if decided is not None:
            for fqn in set(self.decisions) - set(decided):
                node = self.param_nodes[fqn]
                self.place[node] = R
                self.val[node] = _to_meta(self.prog.state[fqn])
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
            for fqn in src or ():
                if fqn not in self.decisions:
                    (self.shard_uses if sharded else self.replicated_uses).add(fqn)

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

    def weight_matmul(self, old, name, x_old, w_old, b_old, out_dim):
        x = self.env[x_old]
        px = self.place[x]
        fqn = tf(w_old)["fqn"]
        w_shape = list(self.prog.state[fqn].shape)
        in_dim = 1 - out_dim if len(w_shape) == 2 else 3 - out_dim   # [E, in, out] expert weights
        if isinstance(px, Partial):
            x, px = self.g(x), R
        if isinstance(px, Replicate) and (px.partial_grad or px.gathered):
            x, px = replicated(self, x)[0], R
        whole_why, pad_to = None, None
        if fqn not in self.decisions and (isinstance(px, Replicate) or (isinstance(px, Shard) and px.seq)):
            heads = _head_count(old)
            out = w_shape[out_dim]
            plain = not _feeds_cross_entropy(old) and not _split_blocks(old, out)
            strict = self.prog.plan.strict
            if fqn in self.avoid:
                why = self.avoid[fqn]
                whole_why = why if why.startswith("its padded") else \
                    f"its shards would reach {why}, which has no sharded rule"
            elif heads is not None and heads % self.t and plain:
                if strict and heads > self.t:
                    local_size(heads, self.t, f"tp={self.t}: heads of {fqn}")  # raises
                if heads > self.t and not strict:   # pad by whole heads (tp_padding.py)
                    pad_to = -(-heads // self.t) * self.t * (out // heads)
                    self.padded[fqn] = f"{heads} heads padded to {pad_to * heads // out} for tp={self.t}"
                else:
                    whole_why = f"its {heads} heads do not divide by tp"
            elif out % self.t and plain:
                if out > self.t and not strict:
                    pad_to = padded(out, self.t)
                    self.padded[fqn] = f"{out} output features padded to {pad_to} for tp={self.t}"
                else:
                    whole_why = f"its {out} output features do not divide by tp"
        if whole_why is not None:
            # GQA/MQA k/v projections whose heads tp does not divide, or projections whose
            # shards would only be gathered again: every rank computes them whole
            self.replicated_weights[fqn] = whole_why
            self.replicated_uses.add(fqn)
            if b_old is not None:
                self.replicated_uses.add(tf(b_old)["fqn"])
            whole = replicated(self, x, x_old.meta.get("val"))[0]
            args = _replace(self._map(old.args), self.env[x_old], whole)
            return self.copy_node(old, args=args, val=_to_meta(old.meta.get("val")))
        if isinstance(px, Shard) and px.seq:
            x, px = self.gather_seq(x, px.dim), Replicate(gathered=True)
        if isinstance(px, Replicate):
            return self.column(old, name, x, px, w_old, b_old, fqn, w_shape, out_dim, pad_to)
        last = len(self.val[x].shape) - 1
        if isinstance(px, Shard) and px.dim == last \
                and self.decisions.get(fqn, (in_dim, px.blocks))[:2] == (in_dim, px.blocks):   # shared weights
            return self.row(old, name, x, px, w_old, b_old, fqn, w_shape, in_dim)
        # sharded on a batch dim (or the weight is already split another way): gather, then
        # treat it as a replicated input
        return fallback(self, old, f"multiplies weight {fqn} with an input sharded {px}")

    def column(self, old, name, x, px, w_old, b_old, fqn, w_shape, out_dim, pad_to=None):
        out = w_shape[out_dim]
        blocks = () if pad_to else _split_blocks(old, out)
        what = f"tp={self.t}: output features of {fqn}"
        if pad_to:
            pad = pad_to
            self.notes.append(f"{fqn}: {self.padded[fqn]} (zero rows; its row-parallel partner gets zero columns)")
        elif blocks:
            for b in blocks:
                local_size(b, self.t, what + f" (block of {b} of a fused projection)")
            pad = out
            if fqn in self.decisions and self.decisions[fqn][1] != blocks:
                raise NoRule(f"tp={self.t}: {fqn} is already split as blocks {list(self.decisions[fqn][1])}")
        elif out % self.t:
            if not _feeds_cross_entropy(old):
                local_size(out, self.t, what)  # raises
            pad = padded(out, self.t)
            self.notes.append(f"{fqn}: vocabulary {out} padded to {pad} for tp={self.t}")
        else:
            pad = out
        self.decide(fqn, out_dim, blocks, pad)
        if b_old is not None:
            self.decide(tf(b_old)["fqn"], 0, blocks, pad)
        xin = x if px.gathered else self.f(x)
        args = self._map(old.args)
        args = _replace(args, self.env[x_old_of(old, name)], xin)
        w_new = self.param_arg(w_old)  # the weight's (and bias's) local shapes, for the shape check
        if b_old is not None:
            self.param_arg(b_old)
        if name in ("mm", "matmul") or name in _GROUPED:
            args = self._transposed_weight(old, args, w_new)
        out_node = self.emit(old.target, args, self._map(old.kwargs), place=Shard(len(old.meta["val"].shape) - 1, blocks))
        self.origin[out_node] = frozenset([fqn])
        return out_node

    def _transposed_weight(self, old, args, w_new):
        """`x @ W.T`: the matmul reads a transpose of the parameter; re-emit it on the shard."""
        arg = old.args[1] if len(old.args) > 1 else None
        if isinstance(arg, fx.Node) and not _is_param(arg) and op_name(arg) in _TRANSPOSES:
            self.maybe_dead.append(self.env[arg])
            t_new = self.emit(arg.target, (w_new,) + tuple(arg.args[1:]), dict(arg.kwargs), place=R, src=arg)
            return _replace(args, self.env[arg], t_new)
        return args

    def row(self, old, name, x, px, w_old, b_old, fqn, w_shape, in_dim):
        true_in = w_shape[in_dim]
        # an input padded for tp (tp_padding.py) meets zero columns, whose gradient is masked
        pad = true_in if px.blocks else self.val[x].shape[-1] * self.t
        self.decide(fqn, in_dim, px.blocks, pad)
        w = self.param_arg(w_old)
        if pad != true_in:
            self.padded.setdefault(fqn, f"{true_in} input features padded to {pad} for tp={self.t}")
            w = self.emit(tp_ops.mask_padding, (w, in_dim, true_in, TP), place=self.place[w], val=self.val[w])
        target = {"linear": aten.linear.default, "addmm": aten.mm.default}.get(name, old.target)
        if not _is_param(old.args[1]) and name != "addmm":   # x @ W.T
            arg = old.args[1]
            self.maybe_dead.append(self.env[arg])
            w = self.emit(arg.target, (w,) + tuple(arg.args[1:]), dict(arg.kwargs), place=R, src=arg)
        extra = tuple(self._map(old.args[2:])) if name in _GROUPED else ()   # group offsets
        partial = self.emit(target, (x, w) + extra, place=P)
        partial._rename(f"{old.name}_partial")
        rank = len(self.val[partial].shape)
        if self.sp and rank == 3:
            out = self.reduce_scatter(partial, 1)
        else:
            out = self.g(partial)
        if b_old is not None:
            b = self.env[b_old]
            self._note_param_uses(old, sharded=isinstance(self.place[out], Shard))
            out = self.emit(aten.add.Tensor, (out, b), place=self.place[out])
        return out

    def embedding(self, old):
        w_old, ids_old = old.args[0], old.args[1]
        fqn = tf(w_old)["fqn"]
        rows = self.prog.state[fqn].shape[0]
        pad = padded(rows, self.t)
        if pad != rows:
            self.notes.append(f"{fqn}: vocabulary {rows} padded to {pad} for tp={self.t}")
        self.decide(fqn, 0, (), pad)
        padding_idx = old.args[2] if len(old.args) > 2 else old.kwargs.get("padding_idx", -1)
        if (old.args[3] if len(old.args) > 3 else old.kwargs.get("scale_grad_by_freq", False)):
            raise PlanError(f"tp={self.t}: embedding {fqn} uses scale_grad_by_freq, which the "
                            "vocab-parallel embedding does not support; turn it off or use tp=1")
        w = self.param_arg(w_old)
        ids = self.env[ids_old]
        full = _to_meta(old.meta["val"])
        if self.sp and full.dim() == 3:
            shape = list(full.shape)
            shape[1], extra = self.seq_shard(shape[1])
            val = torch.empty(shape, dtype=full.dtype, device="meta")
            node = self.emit(tp_ops.vocab_parallel_embedding, (w, self.to_replicated(ids), TP, 1, padding_idx, *extra),
                             place=Shard(1, seq=True), val=val,
                             collective=_coll("reduce_scatter", "forward", full, back="all_gather"))
            if extra:
                self.padded_len[node] = extra[0]
            return node
        args = (w, self.to_replicated(ids), TP) + ((None, padding_idx) if padding_idx >= 0 else ())
        return self.emit(tp_ops.vocab_parallel_embedding, args, place=R, val=full,
                         collective=_coll("all_reduce", "forward", full))

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


from threefold.passes.tp_rules import _IN_PLACE_OK, RULES, padding_safe  # noqa: E402  (rules use the helpers above)
from threefold.passes.tp_report import report_notes, tp_report  # noqa: E402
