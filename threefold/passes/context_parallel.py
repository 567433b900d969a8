"""Context parallelism (plan `cp=N`): the graph traced on this rank's share of each sequence.

The compiler traces at the local sequence length n = S/cp (compiler/api.py cuts the example
batch along the sequence dims passes/seq_dims.py finds), and the runtime feeds each cp rank
blocks r and 2cp-1-r of every sequence (runtime/cp_ops.py). Most ops are then already right:
they treat positions independently. This pass rewrites the ones that are not and checks the rest:

1. Attention becomes ring attention (runtime/cp_ops.ring_attention): the SDPA op, and the
   pattern written by hand, matmul(q, k^T) [* or / a constant] [+ mask | masked_fill(mask,
   -inf)]... -> softmax(-1) [-> cast, dropout(p=0)] -> matmul(., v). Masks (passes/cp_masks.py)
   become what the ring recomputes per pair of blocks: a function of j - i (causal, sliding
   window, ALiBi) from global positions, and a key-side padding bias that travels with K/V;
   any other mask is a PlanError.
2. `arange(n)` over the sequence becomes `cp_ops.positions(n)`: this rank's global positions,
   so learned position embeddings and rotary tables see where the tokens really are.
3. Every op is checked by the sequence rules (passes/cp_rules/): position-local ops keep
   the sequence placement; one that mixes positions runs on the all-gathered sequence
   (passes/cp_fallback.py) where its family allows, else is a PlanError naming it.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.ir.program import tf
from threefold.ir.stages import Sharded, copy_graph_module
from threefold.errors import PlanError
from threefold.passes.cp_masks import evaluate, free, input_free, key_bias_val as _key_bias_val, \
    param_free as _param_free, split_mask as _split_mask
from threefold.ops.families import COPIES, RESHAPES, VIEWS, args_of
from threefold.passes.cp_attention_bias import carries_position_bias, take_position_biases
from threefold.passes.cp_factories import split_factories
from threefold.passes.cp_fallback import gather_around
from threefold.passes.cp_whole import is_whole
from threefold.passes.cp_whole_inputs import whole_inputs
from threefold.passes.cp_rules import PARTIAL, Gather, Place, Refuse, Seq, decide, op_name
from threefold.passes.cp_rules.core import is_local
from threefold.passes.mesh_axes import place_sequence
from threefold.placement import on_mesh_of
from threefold.runtime import cp_ops
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")
_CASTS = COPIES - {"detach", "lift_fresh_copy", "copy"}
_SDPA = {"scaled_dot_product_attention"}


@stage_pass(needs=Sharded, gives=Sharded)
def context_parallel(stage: Sharded) -> Sharded:
    """Needs: the tp-sharded graph traced at the local sequence length. Guarantees (cp>1):
    attention is ring attention, sequence aranges are global positions, and no op mixes
    positions unnoticed (else a PlanError)."""
    if stage.plan.cp == 1:
        return stage.evolve()
    gm = copy_graph_module(stage.gm)
    n = stage.seq_len
    rings = _rewrite_attention(gm, stage, n)
    convs = _causal_convolutions(gm, stage, n)
    moved = _global_positions(gm, n)
    _drop_unread(gm.graph)   # a mask the model builds and never reads (Qwen2-MoE) is not checked
    fallbacks: list = []
    tables: list = []
    place_sequence(gm, check_sequence(gm, stage, fallbacks, tables))   # each value's cp entry (OnMesh)
    gm.graph.lint()
    gm.recompile()
    names = sorted({tf(t.args[0]).get("fqn") for t in tables if tf(t.args[0]).get("fqn")})
    note = (f"cp={stage.plan.cp}: {rings} attention op(s) run as ring attention over the cp group; "
            f"{moved} sequence arange(s) give global positions; {len(tables)} position table(s) sliced to the "
            f"sequence read this rank's rows{' (' + ', '.join(f'`{x}`' for x in names) + ')' if names else ''}; "
            f"{convs} causal conv1d(s) exchange halos; "
            "sequence split in blocks r, 2cp-1-r")
    m = stage.plan.microbatches
    notes = tuple(f"cp fallback: {f['op']} ({f['node']}) at {f['module']} mixes sequence positions: the sequence "
                  f"is all-gathered around it, {2 * m * f['bytes']} bytes per rank per step (all-gather forward, "
                  f"reduce-scatter backward; strict=true refuses it)" for f in fallbacks)
    return stage.evolve(gm=gm, notes=stage.notes + (note,) + notes)


def _drop_unread(graph: fx.Graph) -> None:
    """Erase values nothing reads (but metadata asserts): pure calls only, last first."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or op_name(node) == "_assert_tensor_metadata" or node.is_impure():
            continue
        users = list(node.users)
        if all(op_name(u) == "_assert_tensor_metadata" and not u.users for u in users):
            for u in users:
                graph.erase_node(u)
            graph.erase_node(node)


# -- the sequence rules' decisions, applied ------------------------------------------------------

def check_sequence(gm: fx.GraphModule, stage, fallbacks: list | None = None, tables: list | None = None) -> dict:
    """Every node's sequence placement (name -> Seq | PARTIAL | None), from the rules'
    decisions (passes/cp_rules/): Place keeps it, Gather runs the op on the all-gathered
    sequence (passes/cp_fallback.py, appended to `fallbacks`), Refuse is a PlanError unless
    what it meets is a position table sliced to the local length (then this rank's rows)."""
    fallbacks = [] if fallbacks is None else fallbacks
    tables = [] if tables is None else tables
    state: dict = {}
    for node in gm.graph.nodes:   # live: the fallback's cuts, inserted after a node, are placed in turn
        if node.op == "placeholder":   # a user input's sequence dim: its cp entry (compiler/api.py)
            d = on_mesh_of(node).dim("cp") if tf(node).get("kind") == "input" else None
            state[node] = Seq(d) if d is not None else None
        elif node.op == "output":
            for out in node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]:
                if stage.has_loss and isinstance(state.get(out), Seq):
                    _refuse(node, stage, "the loss is not reduced over the sequence")
                if is_local(state.get(out)):
                    _refuse(node, stage, "returns rows sorted on this rank (a routing sort) or counted on it")
                if is_whole(out):
                    _refuse(node, stage, "returns a grid of positions computed whole on every rank (attention "
                                         "weights?)")
        elif node.op == "call_function":
            d = _place(node, state, stage, fallbacks)
            if isinstance(d, Refuse) and d.table is not None:
                moved = _rows_at_positions(d.table, stage) or split_factories(d.table, state, stage)
                if moved:
                    tables.extend(m for m in moved if op_name(m) == "index_select")
                    _replace_after(moved, node, state, stage, fallbacks)
                    d = _place(node, state, stage, fallbacks)
            if isinstance(d, Refuse):
                _refuse(node, stage, d.why)
    return {n.name: s for n, s in state.items()}


def _place(node, state: dict, stage, fallbacks: list):
    """Apply the rules' decision for one call to `state` (Refuse is returned, not applied)."""
    if any(is_whole(a) for a in node.all_input_nodes):   # computed from a grid kept whole (cp_whole.py)
        return whole_inputs(node, state, stage, fallbacks, _message(node, stage, "mixes sequence positions"))
    if all(state.get(a) is None for a in node.all_input_nodes) and op_name(node) != "shard_seq":
        state[node] = Seq(0) if op_name(node) == "positions" else None
        return None
    d = decide(node, state, stage)
    if isinstance(d, Place):
        state[node] = d.out
    elif isinstance(d, Gather):
        state[node] = gather_around(node, state, stage, _message(node, stage, d.why), fallbacks, op_name(node), Seq)
    return d


def _replace_after(new: list, upto: fx.Node, state: dict, stage, fallbacks: list) -> None:
    """Place again what depends on the `new` nodes, in order, up to (not including) `upto`."""
    seen, stack = set(), list(new)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.users)
    for x in upto.graph.nodes:   # live: a fallback's cuts inserted on the way are placed too
        if x is upto:
            break
        if (x in seen or x not in state) and x.op == "call_function":
            d = _place(x, state, stage, fallbacks)
            if isinstance(d, Refuse):
                _refuse(x, stage, d.why)


def _rows_at_positions(table: fx.Node, stage) -> list:
    """Position tables found by data flow: in what `table` is made of (parameters, buffers,
    constants only), every `t[:n]` along a dim of t that covers the whole sequence (a learned
    position table, position ids or a rotary cache sliced to the traced local length n)
    becomes t.index_select(dim, positions): the rows of this rank's global positions, under
    the load-balanced layout. Returns the new nodes ([] where there is none)."""
    n, whole = stage.seq_len, stage.seq_len * stage.plan.cp
    if not input_free(table):
        return []
    found, seen, stack = [], set(), [table]
    while stack:
        x = stack.pop()
        if not isinstance(x, fx.Node) or x in seen:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
        if x.op != "call_function" or op_name(x) != "slice":
            continue
        a = args_of(x)
        v, start = a["self"].meta.get("val"), a["start"] or 0
        if not isinstance(v, torch.Tensor) or not isinstance(start, int) or a["end"] != start + n or a["step"] != 1 \
                or v.shape[a["dim"] % v.dim()] < start + whole:
            continue
        found.append(x)
    new = []
    for x in found:   # t[start:start+n] -> t.index_select(dim, start + positions) (OPT's offset 2)
        a, graph = args_of(x), x.graph
        v, start = a["self"].meta["val"], a["start"] or 0
        with graph.inserting_before(x):
            pos = graph.call_function(cp_ops.positions, (n, CP), {"device": v.device})
            at = graph.call_function(torch.ops.aten.add.Tensor, (pos, start)) if start else pos
            rows = graph.call_function(torch.ops.aten.index_select.default, (a["self"], a["dim"] % v.dim(), at))
        pos.meta = {"val": torch.arange(n, device=v.device), "tf": dict(tf(x))}
        if start:
            at.meta = {"val": torch.arange(n, device=v.device) + start, "tf": dict(tf(x))}
            new.append(at)
        rows.meta = {"val": x.meta["val"], "tf": dict(tf(x))}
        x.replace_all_uses_with(rows)
        graph.erase_node(x)
        new += [pos, rows]
    return new


def _message(node, stage, why: str) -> str:
    module = tf(node).get("module") or "<top>"
    return (f"cp={stage.plan.cp}: {op_name(node)} at {module} {why}; context parallelism cannot split the "
            "sequence here: use cp=1 for this model (or rewrite the op position-wise)")


def _refuse(node, stage, why: str):
    raise PlanError(_message(node, stage, why))


__all__ = ["context_parallel", "check_sequence", "PARTIAL"]


# -- attention -----------------------------------------------------------------------------

def _rewrite_attention(gm: fx.GraphModule, stage, n: int) -> int:
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
        _erase_dead([last] + dead + [m for _, m in operands], gm.graph)
        count += 1
    return count


def _gatherable_mask(why: str) -> bool:
    """A mask the ring cannot recompute per block but that is exact on the gathered sequence:
    one computed from parameters (Doge's dynamic mask), or over queries as well as keys."""
    return "depends on a parameter" in why or "not key-side" in why


_INDEX_VIEWS = {"unsqueeze", "expand", "add", "sub"} | VIEWS | COPIES


def _indexes_an_input(arange: fx.Node) -> bool:
    """The arange only indexes values that come from inputs (through views and + 0), as HF's
    mask[batch_idx, kv_idx]: there it is the local identity, since the input holds this
    rank's positions already; cp_rules checks the index op."""
    stack, seen, found = [arange], set(), False
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in seen or op_name(u) == "_assert_tensor_metadata":
                continue
            seen.add(u)
            name = op_name(u)
            if name == "index" and u.args[0] is not x and not input_free(u.args[0]):
                found = True
            elif name in _INDEX_VIEWS and (name not in ("add", "sub") or u.args[1] == 0):
                stack.append(u)
            else:
                return False
    return found


def _numbers_rows(arange: fx.Node) -> bool:
    """The arange only numbers rows put at permuted places (inverse[perm] = arange(m), a
    routing sort's inverse): row numbers on this rank, not positions (cp_rules/permutations)."""
    users = _users(arange)
    return bool(users) and all(op_name(u) in ("index_put", "index_put_") and args_of(u)["values"] is arange
                               and args_of(u)["self"] is not arange for u in users)


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


def _users(node: fx.Node) -> list:
    """Users that read the value (dtype/device asserts do not)."""
    return [u for u in node.users if op_name(u) != "_assert_tensor_metadata"]


def _single_user(node: fx.Node):
    users = _users(node)
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
    if sink.meta["val"].shape[-1] != 1 or not input_free(sink) or len(_users(x)) != (2 if nodes else 1):
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
                and len(_users(t)) == 1 and len(_users(inner)) == 1:
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
    if any(len(_users(c)) != 1 for c in chain[1:] + [qk]):
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


def _erase_dead(nodes: list, graph: fx.Graph) -> None:
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


# -- causal convolutions ----------------------------------------------------------------------

def _causal_convolutions(gm: fx.GraphModule, stage, n: int) -> int:
    """conv1d(x, w, b, stride 1, padding k-1, dilation 1, groups) -> slice(time, 0, n): the
    causal convolution of a Mamba-style block -> cp_ops.causal_conv1d, which fetches the k-1
    positions before each block from the rank that holds them (a halo exchange)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or op_name(node) != "conv1d":
            continue
        a = _args(node)
        x, w = a["input"], a["weight"]
        k = w.meta["val"].shape[-1]
        users = _users(node)
        cut = users[0] if len(users) == 1 and op_name(users[0]) == "slice" else None
        if (list(a["stride"]) != [1] or list(a["dilation"]) != [1] or not isinstance(a["padding"], (list, tuple))
                or list(a["padding"]) != [k - 1] or x.meta["val"].shape[-1] != n or cut is None):
            continue   # not the causal form: cp_rules refuses it
        dim, start, end = (list(cut.args[1:4]) + [None, None, None])[:3]
        if dim % cut.meta["val"].dim() != cut.meta["val"].dim() - 1 or start not in (0, None) or end != n:
            continue
        if k - 1 > n // 2:
            raise PlanError(f"cp={stage.plan.cp}: conv1d at {tf(node).get('module') or '<top>'} reaches {k - 1} "
                            f"positions back, more than a block ({n // 2}); use a smaller cp or cp=1")
        with gm.graph.inserting_before(node):
            conv = gm.graph.call_function(cp_ops.causal_conv1d, (x, w, a["bias"], a["groups"], CP),
                                          {"ranks": stage.plan.cp})
        conv.meta = dict(cut.meta)
        conv.meta["tf"] = dict(tf(node))
        cut.replace_all_uses_with(conv)
        _erase_dead([cut, node], gm.graph)
        count += 1
    return count


# -- positions -------------------------------------------------------------------------------

def _global_positions(gm: fx.GraphModule, n: int) -> int:
    """arange(n) / arange(0, n[, 1]) over the sequence -> this rank's global positions."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or op_name(node) != "arange":
            continue
        overload = node.target._overloadname
        args = list(node.args)
        if overload == "default":
            start, end, step = 0, args[0], 1
        elif overload == "start":
            start, end, step = args[0], args[1], 1
        elif overload == "start_step":
            start, end, step = args[0], args[1], args[2]
        else:
            continue
        if (start, end, step) != (0, n, 1) or _indexes_an_input(node) \
                or _numbers_rows(node):
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "device")}
        with gm.graph.inserting_before(node):
            pos = gm.graph.call_function(cp_ops.positions, (n, CP), kwargs)
        pos.meta = dict(node.meta)
        pos.meta["tf"] = dict(tf(node))
        node.replace_all_uses_with(pos)
        gm.graph.erase_node(node)
        count += 1
    return count
