"""The tensor-parallel rewrite's redistributions: the collectives it inserts between values.

Megatron's f (identity forward, all-reduce backward) before a column-parallel matmul, g
(all-reduce forward) after a row-parallel one, and under sequence parallelism the
reduce-scatter / all-gather pair over the sequence dim; scatter and gather along a sharded
dim (block-wise for fused [q|k|v] dims), and `to_replicated` from any placement. Each is
emitted once per value (`_cached`), so q, k and v share one f. A mixin of the rewriter
(tp_rewrite._Rewriter): it reads `self.emit`, `self.place`, `self.val`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.passes.tp_patterns import _coll, _needs_grad
from threefold.passes.tp_placement import R, Partial, Replicate, Shard, local_size, padded
from threefold.passes.tp_redistribute import replicated
from threefold.runtime import tp_ops
from threefold.runtime.tp_ops import TP


class CollectiveEmitter:
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
        local, extra, note = self.seq_shard_of(size)
        if note and note not in self.notes:
            self.notes.append(note)
        return local, extra

    def seq_shard_of(self, size: int) -> tuple[int, tuple, str | None]:
        """seq_shard's answer and the note it leaves (None: tp divides the length)."""
        if size % self.t == 0:
            return size // self.t, (), None
        note = f"sequence length {size} padded to {padded(size, self.t)} for tp={self.t} (sp)"
        return padded(size, self.t) // self.t, (size,), note

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
