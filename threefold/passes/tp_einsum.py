"""einsum against a parameter ('btc,hdc->bhtd', 'bhtd,chd->btc', 'btc,cf->btf'), Megatron's way.

Column-parallel: the activation is replicated; the parameter is split on its free index
that comes first in the output (the heads of 'hdc', the features of 'cf'), so the output
is sharded there. Row-parallel: the activation is sharded on an index the parameter
contracts; the parameter is split on that index and the partial sums are reduced (g, or a
reduce-scatter of the sequence under SP). Anything else is NoRule (the fallback gathers).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.passes.tp_patterns import _is_param
from threefold.passes.tp_placement import Partial, Replicate, Shard
from threefold.passes.tp_redistribute import NoRule, replicated

aten = torch.ops.aten


def einsum_param(old: fx.Node):
    """(equation parts, activation, parameter, param position) for a 2-operand einsum with one parameter."""
    eq, ops = old.args[0], old.args[1]
    if len(ops) != 2 or "->" not in eq or "." in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    subs = ins.split(",")
    params = [i for i, o in enumerate(ops) if _is_param(o)]
    if len(params) != 1:
        return None
    i = params[0]
    return (subs, out), ops[1 - i], ops[i], i


def einsum_matmul(rw, old: fx.Node) -> fx.Node:
    (subs, out), x_old, w_old, wi = einsum_param(old)
    xs, ws = subs[1 - wi], subs[wi]
    fqn = tf(w_old)["fqn"]
    x = rw.env[x_old]
    px = rw.place[x]
    shape = list(rw.prog.state[fqn].shape)
    if isinstance(px, Replicate) and (px.partial_grad or px.gathered):
        x, px = replicated(rw, x)[0], Replicate()
    if isinstance(px, Partial):
        x, px = rw.g(x), Replicate()
    if isinstance(px, Shard) and px.seq:
        x, px = rw.gather_seq(x, px.dim), Replicate(gathered=True)
    if fqn in rw.avoid and fqn not in rw.decisions and isinstance(px, Replicate):
        rw.replicated_weights[fqn] = f"its shards would reach {rw.avoid[fqn]}, which has no sharded rule"
        rw.replicated_uses.add(fqn)
        return _emit(rw, old, x, rw.env[w_old], wi, Replicate())
    if isinstance(px, Replicate):
        free = [c for c in out if c in ws and c not in xs]
        if not free:
            raise NoRule(f"tp={rw.t}: {rw._where()} has no output index of {fqn} to split")
        letter = free[0]
        dim = ws.index(letter)
        if shape[dim] % rw.t:
            raise NoRule(f"tp={rw.t}: {rw._where()}: index {letter} of {fqn} ({shape[dim]}) does not divide by tp")
        rw.decide(fqn, dim, (), shape[dim])
        xin = x if px.gathered else rw.f(x)
        node = _emit(rw, old, xin, rw.param_arg(w_old), wi, Shard(out.index(letter)))
        rw.origin[node] = frozenset([fqn])
        return node
    if not isinstance(px, Shard) or px.blocks:
        raise NoRule(f"tp={rw.t}: {rw._where()} multiplies {fqn} with an input placed {px}")
    letter = xs[px.dim]
    if letter not in ws or letter in out:
        raise NoRule(f"tp={rw.t}: {rw._where()} is sharded on index {letter}, which {fqn} does not contract")
    rw.decide(fqn, ws.index(letter), (), shape[ws.index(letter)])
    partial = _emit(rw, old, x, rw.param_arg(w_old), wi, Partial())
    partial._rename(f"{old.name}_partial")
    if rw.sp and len(old.meta["val"].shape) == 3:
        return rw.reduce_scatter(partial, 1)
    return rw.g(partial)


def _emit(rw, old, x, w, wi, place):
    ops = [x, w] if wi == 1 else [w, x]
    return rw.emit(old.target, (old.args[0], ops) + tuple(old.args[2:]), dict(old.kwargs), place=place)
