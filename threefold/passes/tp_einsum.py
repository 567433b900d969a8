"""einsum against a parameter ('btc,hdc->bhtd', 'bhtd,chd->btc', 'btc,cf->btf'), Megatron's way.

Column-parallel: the activation is replicated; the parameter is split on its free index
that comes first in the output (the heads of 'hdc', the features of 'cf'), so the output
is sharded there. Row-parallel: the activation is sharded on an index the parameter
contracts; the parameter is split on that index and the partial sums are reduced (g, or a
reduce-scatter of the sequence under SP). Anything else is NoRule (the fallback gathers).
`einsum_matmul` returns the decision (tp_weights' operand vocabulary); the pass writes it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.ops.rules import Op
from threefold.passes.tp_decisions import REDUCE, ParamCut, ReduceScatter, TpDecision
from threefold.passes.tp_patterns import _is_param
from threefold.passes.tp_placement import Partial, Replicate, Shard
from threefold.passes.tp_redistribute import NoRule
from threefold.passes.tp_weights import LocalParam, MatmulInput, matmul_input_place

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


def einsum_matmul(rw, old: fx.Node) -> TpDecision:
    (subs, out), x_old, w_old, wi = einsum_param(old)
    xs, ws = subs[1 - wi], subs[wi]
    fqn = tf(w_old)["fqn"]
    px = matmul_input_place(rw, rw.env[x_old])
    shape = list(rw.prog.state[fqn].shape)
    if isinstance(px, Shard) and px.seq:
        px = Replicate(gathered=True)
    if fqn in rw.avoid and fqn not in rw.decisions and isinstance(px, Replicate):
        # every rank computes it whole: a sequence shard arrives by a plain all-gather (the
        # column path's gather reduce-scatters its gradient, t times this use's whole one)
        return TpDecision(Replicate(), {x_old: MatmulInput("whole")},
                          kept=((fqn, f"its shards would reach {rw.avoid[fqn]}, which has no sharded rule"),),
                          whole_uses=frozenset([fqn]))
    if isinstance(px, Replicate):
        free = [c for c in out if c in ws and c not in xs]
        if not free:
            raise NoRule(f"tp={rw.t}: {rw._where()} has no output index of {fqn} to split")
        letter = free[0]
        dim = ws.index(letter)
        if shape[dim] % rw.t:
            raise NoRule(f"tp={rw.t}: {rw._where()}: index {letter} of {fqn} ({shape[dim]}) does not divide by tp")
        return TpDecision(Shard(out.index(letter)), {x_old: MatmulInput("f"), w_old: LocalParam()},
                          cuts=(ParamCut(fqn, dim, (), shape[dim]),), origin=frozenset([fqn]))
    if not isinstance(px, Shard) or px.blocks:
        raise NoRule(f"tp={rw.t}: {rw._where()} multiplies {fqn} with an input placed {px}")
    letter = xs[px.dim]
    if letter not in ws or letter in out:
        raise NoRule(f"tp={rw.t}: {rw._where()} is sharded on index {letter}, which {fqn} does not contract")
    sp = rw.sp and len(old.meta["val"].shape) == 3
    return TpDecision(Shard(1, seq=True) if sp else Replicate(), {w_old: LocalParam()},
                      Op(old.target, old.args, old.kwargs, place=Partial(), name=f"{old.name}_partial"),
                      (ReduceScatter(1) if sp else REDUCE,), cuts=(ParamCut(fqn, ws.index(letter), (), shape[ws.index(letter)]),))
