"""Linears whose weight is a piece of a parameter: `w_q, w_kv = in_proj_weight.split([E, 2E])`
(nn.MultiheadAttention's cross attention, any fused weight cut before the matmul).

The parameter is split block-wise so each rank holds its 1/t of every piece, and of every
block inside a piece whose output is split again (kv's [k | v]); each piece's linear is
column-parallel on the local piece. Only when every piece of the split feeds linears.
`piece_matmul` returns the decision; its pieces arrive as `LocalPiece`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.passes.tp_decisions import ParamCut, TpDecision
from threefold.passes.tp_patterns import _head_count, _is_param, _split_blocks
from threefold.passes.tp_placement import Replicate, Shard
from threefold.passes.tp_weights import MatmulInput
from threefold.ops.families import RESHAPES, SPLITS
from threefold.ops.rules import Op

aten = torch.ops.aten


def weight_piece(node) -> tuple[fx.Node, fx.Node, int] | None:
    """(split node, parameter, piece index) if `node` is getitem(split(param, .., dim 0), i)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    split = node.args[0]
    if not isinstance(split, fx.Node) or op_name(split) not in SPLITS or not _is_param(split.args[0]):
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim != 0:
        return None
    return split, split.args[0], node.args[1]


def _sizes(split: fx.Node) -> list[int]:
    return [int(v.shape[0]) for v in split.meta["val"]]


def piece_layout(split: fx.Node) -> list[tuple[int, ...]] | None:
    """The blocks of every piece (a piece whose linear output is split again has several);
    None unless each piece is read only as the weight (or bias) of linears."""
    sizes = [int(v.shape[0]) for v in split.meta["val"]]
    pieces: list[tuple[int, ...] | None] = [None] * len(sizes)
    for get in split.users:
        if get.target is not operator.getitem:
            return None
        i = get.args[1]
        for lin in get.users:
            if op_name(lin) != "linear" or lin.args[0] is get:
                return None
            if lin.args[1] is get:
                blocks = _split_blocks(lin, sizes[i]) or (sizes[i],)
            else:
                blocks = pieces[i] or (sizes[i],)
            if pieces[i] not in (None, blocks):
                return None
            pieces[i] = blocks
    if any(p is None for p in pieces):
        return None
    return pieces


@dataclass(frozen=True)
class LocalPiece:
    """A piece of a parameter split before its linears, as this rank holds it: a split of
    the local parameter into the local pieces (`layout` per piece, `kept`: pieces held whole)."""
    layout: tuple
    kept: tuple

    def bring(self, rw, x: fx.Node, old: fx.Node) -> fx.Node:
        split = old.args[0]
        return _local_piece(rw, split, split.args[0], self.layout, old.args[1], self.kept)


def piece_matmul(rw, old: fx.Node) -> TpDecision | None:
    """Column-parallel linear on a piece of a parameter; None if the layout does not allow it."""
    w_get = old.args[1]
    b_get = old.args[2] if len(old.args) > 2 else None
    split, param, i = weight_piece(w_get)
    fqn = tf(param)["fqn"]
    layout = piece_layout(split)
    px = rw.place[rw.env[old.args[0]]]
    if layout is None or fqn in rw.avoid or fqn in rw.replicated_uses or not isinstance(px, Replicate) \
            or px.gathered or px.partial_grad:
        return None
    bias = weight_piece(b_get) if b_get is not None else None
    if b_get is not None and (bias is None or bias[2] != i or _sizes(bias[0]) != [sum(p) for p in layout]
                              or any(op_name(u) != "linear" for g in bias[0].users for u in g.users)):
        return None
    # a piece whose shards could not be followed (Falcon's one key head) is kept whole on
    # every rank while the others stay sharded: the parameter's ShardSpec marks its blocks
    # from the start where its heads do not divide by tp, as for any projection
    heads = _piece_heads(split, len(layout))
    kept = tuple(piece_key(fqn, j) in rw.avoid or (heads[j] is not None and heads[j] % rw.t != 0)
                 for j in range(len(layout)))
    if all(kept):
        return None
    blocks = tuple(b for piece in layout for b in piece)
    whole = tuple(k for piece, k in zip(layout, kept) for _ in piece)
    if any(b % rw.t for b, w in zip(blocks, whole) if not w) \
            or (fqn in rw.decisions and (rw.decisions[fqn][1] != blocks
                                         or rw.whole_blocks.get(fqn, ()) != (whole if any(whole) else ()))):
        return None
    rows = sum(blocks)
    names = [fqn] + ([tf(bias[1])["fqn"]] if bias is not None else [])
    cuts = tuple(ParamCut(name, 0, blocks, rows, whole if any(whole) else ()) for name in names)
    piece = LocalPiece(tuple(layout), kept)
    needs = {w_get: piece} | ({b_get: piece} if bias is not None else {})
    if kept[i]:
        why = rw.avoid.get(piece_key(fqn, i)) or f"its {heads[i]} heads, which do not divide by tp={rw.t}"
        note = f"tp: {fqn} piece {i} ({sum(layout[i])} rows) kept whole on every rank: " \
               + (why if why.startswith("its ") else f"its shards would reach {why}")
        return TpDecision(Replicate(), needs, Op(aten.linear.default, old.args[:3]), cuts=cuts, notes=(note,),
                          first=(w_get,))
    needs[old.args[0]] = MatmulInput("f")
    out = Shard(len(old.meta["val"].shape) - 1, layout[i] if len(layout[i]) > 1 else ())
    return TpDecision(out, needs, Op(aten.linear.default, old.args[:3]), cuts=cuts, first=(w_get,),
                      origin=frozenset([piece_key(fqn, i)]))


def _piece_heads(split: fx.Node, n: int) -> list[int | None]:
    """Per piece, the heads its linear's output is viewed as ([.., heads, head_dim])."""
    out: list[int | None] = [None] * n
    for get in split.users:
        for lin in get.users:
            if op_name(lin) == "linear" and lin.args[1] is get:
                out[get.args[1]] = _head_count(lin)
                last = lin.meta["val"].shape[-1]
                for v in lin.users:   # a single head: [.., 1, head_dim]
                    shape = list(v.meta["val"].shape) if op_name(v) in RESHAPES else []
                    if len(shape) >= 2 and shape[-2] == 1 and shape[-1] == last:
                        out[get.args[1]] = 1
    return out


def piece_key(fqn: str, i: int) -> str:
    """How the pass names piece i of a parameter split before its linears (blame, avoid)."""
    return f"{fqn}#piece{i}"


def _local_piece(rw, split, param, layout, i, kept):
    """getitem(split_with_sizes(local param, local piece sizes), i), once per split."""
    def make():
        rw.maybe_dead.append(rw.env[split])
        for get in split.users:
            rw.maybe_dead.append(rw.env[get])
        local = [sum(piece) if k else sum(b // rw.t for b in piece) for piece, k in zip(layout, kept)]
        return rw.emit(aten.split_with_sizes.default, (rw.param_arg(param), local, 0),
                       place=[Shard(0)] * len(local), src=split)
    node = rw._cached(("piece", split), make)
    return rw._cached(("piece", split, i), lambda: rw.emit(
        operator.getitem, (node, i), place=Shard(0), val=rw.val[node][i], src=split))
