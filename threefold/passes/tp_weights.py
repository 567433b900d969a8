"""The tensor-parallel rewrite of weight matmuls and embeddings: Megatron's column and row
parallel linears and the vocab-parallel embedding.

`weight_matmul` decides a matmul with a parameter weight from its input's placement: a
replicated input makes it column-parallel (weight cut on the output features, f before it,
fused projections cut block-wise, heads tp does not divide padded), an input sharded on the
contracted dim row-parallel (output Partial, reduced by g or, under sp, reduce-scattered;
the bias added after). An embedding indexed by user input is vocab-parallel. A mixin of the
rewriter (tensor_parallel._Rewriter): it reads `self.emit`, `self.decide`, `self.f` / `g`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.errors import PlanError
from threefold.ops.families import GROUPED_MATMULS, TRANSPOSES
from threefold.passes.tp_patterns import (_coll, _feeds_cross_entropy, _head_count,
                                          _is_param, _replace, _split_blocks, x_old_of)
from threefold.passes.tp_placement import P, R, Partial, Replicate, Shard, local_size, padded, to_meta
from threefold.passes.tp_redistribute import NoRule, fallback, replicated
from threefold.runtime import tp_ops
from threefold.runtime.tp_ops import TP

aten = torch.ops.aten


class WeightRewrites:
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
            return self.copy_node(old, args=args, val=to_meta(old.meta.get("val")))
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
        if name in ("mm", "matmul") or name in GROUPED_MATMULS:
            args = self._transposed_weight(old, args, w_new)
        out_node = self.emit(old.target, args, self._map(old.kwargs), place=Shard(len(old.meta["val"].shape) - 1, blocks))
        self.origin[out_node] = frozenset([fqn])
        return out_node

    def _transposed_weight(self, old, args, w_new):
        """`x @ W.T`: the matmul reads a transpose of the parameter; re-emit it on the shard."""
        arg = old.args[1] if len(old.args) > 1 else None
        if isinstance(arg, fx.Node) and not _is_param(arg) and op_name(arg) in TRANSPOSES:
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
        extra = tuple(self._map(old.args[2:])) if name in GROUPED_MATMULS else ()   # group offsets
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
        full = to_meta(old.meta["val"])
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
