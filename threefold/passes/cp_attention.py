"""Attention under context parallelism: find it, and replace it with ring attention.

The SDPA op, or attention written by hand (matmul / einsum of q and k^T, an optional scale,
masks added or filled with -inf, softmax over the keys, matmul / einsum with v; soft-capping
and attention sinks on the way), becomes `cp_ops.ring_attention` over the cp group. Its masks
are split by passes/cp_masks.py into what the ring recomputes per pair of blocks, position
biases by passes/cp_attention_bias.py into one block per ring step; an SDPA whose mask the ring
cannot carry is left for the all-gather fallback (passes/cp_fallback.py).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ir.program import tf
from threefold.ops.families import COPIES, RESHAPES, args_of, op_name
from threefold.passes.cp_attention_bias import carries_position_bias, take_position_biases
from threefold.passes.cp_masks import evaluate, free, input_free, key_bias_val as _key_bias_val, \
    param_free as _param_free, split_mask as _split_mask
from threefold.runtime import cp_ops
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")
_CASTS = COPIES - {"detach", "lift_fresh_copy"}
_SDPA = {"scaled_dot_product_attention"}


def rewrite_attention(gm: fx.GraphModule, stage, n: int) -> int:
    count, biases = 0, {}   # biases: a position bias's per-step blocks, shared by the layers reading it
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or getattr(node, "_erased", False):   # erased by an earlier rewrite
            continue
        name = op_name(node)
        if name in _SDPA:
            found = _sdpa(node)
        elif name in ("softmax", "_softmax"):
            found = _handwritten(node, stage)
        else:
            continue
        if found is None:
            continue
        q, k, v, scale, masks, causal, last, dead, (softcap, sink) = found
        if name in _SDPA and _args(node).get("enable_gqa"):
            k, v = (_repeat_heads(gm.graph, x, q, last) for x in (k, v))
        kwargs = {"ranks": stage.plan.cp}
        if softcap is not None:
            kwargs["softcap"] = softcap
        if sink is not None:
            kwargs["sink"] = sink
        operands = masks
        masks, pbias = take_position_biases(masks, stage, n, biases, last)   # passes/cp_attention_bias.py
        if pbias is not None:
            kwargs["pbias"] = pbias
        if masks or causal:
            try:
                causal, rel, keyside = _split_mask(masks, causal, stage, last, n)   # leading dims as the ring sees them
            except PlanError as exc:
                if name not in _SDPA or pbias is not None or not _gatherable_mask(str(exc)):
                    raise
                continue   # SDPA whose mask the ring cannot carry: the all-gather fallback runs it whole
            if rel is not None:
                kwargs["rel"] = rel
            if keyside:
                with gm.graph.inserting_before(last):
                    kb = gm.graph.call_function(cp_ops.key_bias, ([p for _, p in keyside], [k_ for k_, _ in keyside]))
                kb.meta = {"val": _key_bias_val(keyside), "tf": dict(tf(last))}
                kwargs["kbias"] = kb
        with gm.graph.inserting_before(last):
            ring = gm.graph.call_function(cp_ops.ring_attention, (q, k, v, float(scale), bool(causal), CP), kwargs)
        ring.meta = dict(last.meta)
        ring.meta["tf"] = dict(tf(last))
        last.replace_all_uses_with(ring)
        erase_dead([last] + dead + [m for _, m in operands], gm.graph)
        count += 1
    return count


def _gatherable_mask(why: str) -> bool:
    """A mask the ring cannot recompute per block but that is exact on the gathered sequence:
    one computed from parameters (Doge's dynamic mask), or over queries as well as keys."""
    return "depends on a parameter" in why or "not key-side" in why


_args = args_of   # an ATen call's arguments by schema name (defaults filled in)


def _sdpa(node: fx.Node):
    a = _args(node)
    where = f"{op_name(node)} at {tf(node).get('module') or '<top>'}"
    if a.get("dropout_p"):
        raise PlanError(f"cp: {where} has attention dropout p={a['dropout_p']}; ring attention has no "
                        "dropout yet: set the attention dropout to 0 or use cp=1")
    q, k, v = a["query"], a["key"], a["value"]
    scale = a.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.meta["val"].shape[-1])
    mask = a.get("attn_mask")
    masks = [] if mask is None else [("visible" if mask.meta["val"].dtype == torch.bool else "add", mask)]
    return q, k, v, scale, masks, bool(a.get("is_causal")), node, [], (None, None)


def _repeat_heads(graph: fx.Graph, kv: fx.Node, q: fx.Node, before: fx.Node) -> fx.Node:
    """SDPA's enable_gqa, spelled out for the ring: each key/value head repeated for its
    group of query heads (dim -3), as SDPA does internally."""
    heads, kv_heads = q.meta["val"].shape[-3], kv.meta["val"].shape[-3]
    if heads == kv_heads:
        return kv
    with graph.inserting_before(before):
        r = graph.call_function(torch.ops.aten.repeat_interleave.self_int, (kv, heads // kv_heads, -3))
    r.meta = {"val": kv.meta["val"].repeat_interleave(heads // kv_heads, -3), "tf": dict(tf(before))}
    return r


def readers(node: fx.Node) -> list:
    """Users that read the value (dtype/device asserts do not)."""
    return [u for u in node.users if op_name(u) != "_assert_tensor_metadata"]


def _single_user(node: fx.Node):
    users = readers(node)
    return users[0] if len(users) == 1 else None


def _sink(x):
    """(scores, sink, [nodes]) for cat([scores, sink], -1) [- max(., -1, keepdim)] with a sink
    [..., n, 1] of parameters (attention sinks, gpt-oss; the max is the softmax's own
    stabiliser), else (x, None, [])."""
    orig, nodes = x, []
    if isinstance(x, fx.Node) and op_name(x) == "sub" and isinstance(x.args[1], fx.Node):
        m = x.args[1]
        base = m.args[0] if m.target is operator.getitem and m.args[1] == 0 else m
        if op_name(base) in ("max", "amax") and base.args[0] is x.args[0] and _args(base).get("keepdim"):
            nodes, x = ([x, m, base] if base is not m else [x, m]), x.args[0]
    if not (isinstance(x, fx.Node) and op_name(x) == "cat" and x.meta.get("val") is not None):
        return orig, None, []
    a, val = _args(x), x.meta["val"]
    if len(a["tensors"]) != 2 or a["dim"] % val.dim() != val.dim() - 1:
        return orig, None, []
    scores, sink = a["tensors"]
    if sink.meta["val"].shape[-1] != 1 or not input_free(sink) or len(readers(x)) != (2 if nodes else 1):
        return orig, None, []
    return scores, sink, nodes + [x]


def _drops_last(u: fx.Node, y: fx.Node) -> bool:
    """u = y[..., :-1] (the last column of the last dim dropped)."""
    a, n = _args(u), y.meta["val"].shape[-1]
    return a["dim"] % y.meta["val"].dim() == y.meta["val"].dim() - 1 and (a["start"] or 0) == 0 \
        and a["end"] in (-1, n - 1) and a["step"] == 1


def _softcap(x):
    """((cap, [its nodes]), scores) for cap * tanh(scores / cap) (Gemma 2's logit soft-capping),
    else ((None, []), x)."""
    if isinstance(x, fx.Node) and op_name(x) == "mul" and isinstance(x.args[1], (int, float)) \
            and isinstance(x.args[0], fx.Node) and op_name(x.args[0]) == "tanh":
        t = x.args[0]
        inner = t.args[0]
        if isinstance(inner, fx.Node) and op_name(inner) == "div" and inner.args[1] == x.args[1] \
                and len(readers(t)) == 1 and len(readers(inner)) == 1:
            return (float(x.args[1]), [x, t, inner]), inner.args[0]
    return (None, []), x


def _same_tail(x: fx.Node) -> bool:
    """A reshape of the scores' leading dims only ([b, h, i, j] <-> [b*h, i, j]: Bloom, XGLM)."""
    if op_name(x) not in RESHAPES or not isinstance(x.args[0], fx.Node):
        return False
    a, b = x.args[0].meta.get("val"), x.meta.get("val")
    return a is not None and b is not None and a.dim() >= 2 and b.dim() >= 2 and a.shape[-2:] == b.shape[-2:]


def _floor(x: fx.Node, stage) -> bool:
    """max(scores, finfo.min): a floor that changes no score a softmax keeps (XGLM)."""
    return op_name(x) in ("max", "maximum", "clamp_min") and len(x.args) == 2 and isinstance(x.args[0], fx.Node) \
        and x.args[0].meta.get("val") is not None and x.meta.get("val") is not None \
        and x.args[0].meta["val"].shape == x.meta["val"].shape and _hides(x.args[1], stage)


def _hides(x, stage) -> bool:
    """A score of -inf (or finfo.min), given as a number or as a constant tensor of one value."""
    if isinstance(x, (int, float)):
        return x <= -1e30
    if not isinstance(x, fx.Node) or not free(x) or x.meta.get("val") is None or x.meta["val"].numel() != 1:
        return False
    try:
        return float(evaluate(x, stage)) <= -1e30
    except Exception:
        return False


def _handwritten(sm: fx.Node, stage=None):
    """matmul(q, k^T) [scale] [mask] -> softmax(-1) [casts, dropout(0)] -> matmul(., v), or None."""
    val = sm.meta.get("val")
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    if val is None or dim not in (-1, val.dim() - 1):
        return None
    chain = [sm]
    x = sm.args[0]
    while isinstance(x, fx.Node) and (op_name(x) in _CASTS or _same_tail(x) or _floor(x, stage)):
        chain.append(x)
        x = x.args[0]
    x, sink, extra = _sink(x)   # softmax(cat([scores, sink]) - max) (gpt-oss): the ring merges the sink
    masks = []   # (kind, node): masked_fill(-inf) masks hide where True; added masks are biases
    while isinstance(x, fx.Node):
        name = op_name(x)
        if name in _CASTS or _same_tail(x) or _floor(x, stage):
            chain.append(x)
            x = x.args[0]
        elif name == "masked_fill" and isinstance(x.args[2], (int, float)) and x.args[2] <= -1e30:
            masks.append(("hidden", x.args[1]))
            chain.append(x)
            x = x.args[0]
        elif name == "where" and len(x.args) == 3 and _hides(x.args[2], stage) and isinstance(x.args[1], fx.Node):
            masks.append(("visible", x.args[0]))        # where(visible, scores, -inf) (GPT-Neo)
            chain.append(x)
            x = x.args[1]
        elif name == "where" and len(x.args) == 3 and _hides(x.args[1], stage) and isinstance(x.args[2], fx.Node):
            masks.append(("hidden", x.args[0]))         # where(hidden, -inf, scores)
            chain.append(x)
            x = x.args[2]
        elif name == "add" and len(x.args) == 2 and all(isinstance(a, fx.Node) for a in x.args):
            left, right = x.args
            if _param_free(right) and not _param_free(left):
                masks.append(("add", right))
                chain.append(x)
                x = left
            elif _param_free(left) and not _param_free(right):
                masks.append(("add", left))
                chain.append(x)
                x = right
            elif stage is not None and carries_position_bias(right, stage.seq_len):   # T5's learned buckets
                masks.append(("add", right))
                chain.append(x)
                x = left
            elif stage is not None and carries_position_bias(left, stage.seq_len):
                masks.append(("add", left))
                chain.append(x)
                x = right
            else:
                return None
        else:
            break
    cap, x = _softcap(x)
    scale = 1.0
    while isinstance(x, fx.Node) and op_name(x) in ("mul", "div") and isinstance(x.args[1], (int, float)):
        scale = scale * x.args[1] if op_name(x) == "mul" else scale / x.args[1]
        chain.append(x)
        x = x.args[0]
    if not (isinstance(x, fx.Node) and op_name(x) in ("matmul", "bmm", "einsum", "baddbmm")):
        return None
    qk = x
    if op_name(qk) == "baddbmm":   # beta * bias + alpha * q k^T (Bloom's ALiBi): the bias is a mask
        a = _args(qk)
        if a["beta"] != 1 or not isinstance(a["alpha"], (int, float)) or not isinstance(a["self"], fx.Node) \
                or not _param_free(a["self"]):
            return None
        masks.append(("add", a["self"]))
        scale *= a["alpha"]
        q, kt = a["batch1"], a["batch2"]
        k = _untransposed(kt)
        if k is None:
            return None
    elif op_name(qk) == "einsum":
        found = _einsum_qk(qk)
        if found is None:
            return None
        (q, k), kt = found, None
    else:
        q, kt = qk.args[0], qk.args[1]
        k = _untransposed(kt)
        if k is None:
            return None
    # forward: softmax -> casts / dropout(0) -> matmul(p, v)
    y, after = sm, []
    while True:
        u = _single_user(y)
        if u is None:
            return None
        name = op_name(u)
        if sink is not None and y is sm and name == "slice" and _drops_last(u, y):
            after.append(u)   # probabilities[..., :-1]: the sink's column dropped
            y = u
            continue
        if name in _CASTS or _same_tail(u):
            after.append(u)
            y = u
            continue
        if name == "dropout":
            p = u.args[1] if len(u.args) > 1 else u.kwargs.get("p", 0.0)
            if p:
                raise PlanError(f"cp: attention dropout p={p} at {tf(u).get('module') or '<top>'}; ring "
                                "attention has no dropout yet: set it to 0 or use cp=1")
            after.append(u)
            y = u
            continue
        if name in ("matmul", "bmm") and u.args[0] is y:
            pv, v = u, u.args[1]
            break
        if name == "einsum" and _args(u)["tensors"][0] is y and _einsum_pv(u) is not None:
            pv, v = u, _einsum_pv(u)
            break
        return None
    if any(len(readers(c)) != 1 for c in chain[1:] + [qk]):
        return None   # an intermediate (scores, probabilities) is used elsewhere: not rewritable
    dead = after[::-1] + chain + [qk] + ([kt] if kt is not None else [])
    k, v = (_with_heads(x, q, pv) for x in (k, v))
    if sink is not None and tuple(sink.meta["val"].shape[:-1]) != tuple(pv.meta["val"].shape[:-1]):
        return None   # the sink's rows are not the ring's queries (scores viewed over their leading dims)
    return q, k, v, scale, masks, False, pv, dead + cap[1] + extra, (cap[0], sink)


def _letters(node: fx.Node):
    """(operand letters, output letters) of a two-operand einsum without ellipses, or None."""
    eq = _args(node)["equation"].replace(" ", "")
    ins, arrow, out = eq.partition("->")
    subs = ins.split(",")
    if not arrow or len(subs) != 2 or "." in eq:
        return None
    return subs, out


def _einsum_qk(node: fx.Node):
    """einsum('b h i d, b h j d -> b h i j', q, k) (k may lack the head letter, multi-query):
    (q, k), else None."""
    found = _letters(node)
    if found is None:
        return None
    (qs, ks), out = found
    if len(qs) < 3 or len(ks) < 2 or qs[-1] != ks[-1] or qs[-1] in out or out != qs[:-1] + ks[-2] \
            or ks[:-2] not in (qs[:-2], qs[:-3]):
        return None
    return tuple(_args(node)["tensors"])


def _einsum_pv(node: fx.Node):
    """einsum('b h i j, b h j d -> b h i d', p, v): v, else None."""
    found = _letters(node)
    if found is None:
        return None
    (ps, vs), out = found
    if len(ps) < 3 or len(vs) < 2 or vs[-2] != ps[-1] or ps[-1] in out or out != ps[:-1] + vs[-1] \
            or vs[:-2] not in (ps[:-2], ps[:-3]):
        return None
    return _args(node)["tensors"][1]


def _with_heads(kv: fx.Node, q: fx.Node, before: fx.Node) -> fx.Node:
    """A key/value without the head dim (multi-query, [b, j, d]) expanded over q's heads, as
    the einsum broadcasts it."""
    qv, val = q.meta["val"], kv.meta["val"]
    if val.dim() == qv.dim():
        return kv
    graph = before.graph
    shape = list(qv.shape[:-2]) + list(val.shape[-2:])
    with graph.inserting_before(before):
        u = graph.call_function(torch.ops.aten.unsqueeze.default, (kv, -3))
        e = graph.call_function(torch.ops.aten.expand.default, (u, shape))
    u.meta = {"val": val.unsqueeze(-3), "tf": dict(tf(before))}
    e.meta = {"val": val.unsqueeze(-3).expand(shape), "tf": dict(tf(before))}
    return e


def _untransposed(kt: fx.Node):
    """k for kt = k^T over its last two dims (transpose / t / permute), else None."""
    if not isinstance(kt, fx.Node):
        return None
    name, rank = op_name(kt), kt.meta["val"].dim()
    if name == "transpose":
        dims = {d % rank for d in kt.args[1:3]}
        return kt.args[0] if dims == {rank - 2, rank - 1} else None
    if name == "t" and rank == 2:
        return kt.args[0]
    if name == "permute":
        perm = [d % rank for d in kt.args[1]]
        return kt.args[0] if perm == list(range(rank - 2)) + [rank - 1, rank - 2] else None
    return None


def erase_dead(nodes: list, graph: fx.Graph) -> None:
    """Erase `nodes` and what only they used, once nothing (but metadata asserts) uses them."""
    stack, erased = [n for n in nodes if isinstance(n, fx.Node)], set()
    while stack:
        n = stack.pop()
        if n in erased or n.op != "call_function":
            continue
        users = list(n.users)
        if any(op_name(u) != "_assert_tensor_metadata" for u in users):
            continue
        for u in users:
            graph.erase_node(u)
            erased.add(u)
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)
