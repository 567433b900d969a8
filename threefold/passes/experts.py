"""Find mixture-of-experts computation in the chunk graphs, from structure alone.

An *expert matmul* is an op with three tensor operands: rows `x` [S, in], a weight
[E, in, out] that is a parameter (or a transpose of one's last two dims: [E, out, in]) and
offsets [E] of an integer dtype, giving [S, out]: the rows are sorted by expert and
offs[e] is where expert e's rows end (a grouped matmul; Hugging Face's MoE blocks trace to
one under transformers 5.x, torch._grouped_mm is another). The router upstream (scores,
softmax/sigmoid, top-k, the sort by expert) and the weighted combine downstream stay where
they are: they are per-token work on the rank that owns the token.

An *expert region* is the expert matmuls sharing one offsets value plus the ops on the
paths between them (the activation, the gate product, casts). Every op of a region must be
row-wise, so that a row's result depends only on that row and its expert's weights: then
the region can run on any rank that holds the expert, on any set of rows, and give the
rows the single process gives them. Anything else is a PlanError naming the op.

Guarantees: `chunk.experts` is a tuple of regions {"name" (module path), "nodes" (compute
nodes in graph order), "offs", "rows", "weights", "others", "outputs" (node names),
"experts" (E), "params" (FQN -> E), "dims" (node name -> the dim holding its rows; None for
an input every expert reads whole)}. Under ep=N a model with no region, or an E that N
does not divide, is a PlanError. Codegen writes each region as a method that
ChunkModule.experts runs on the ranks holding its experts (runtime/experts.py). Which ops a
region may hold is ep's region rules' answer (passes/ep_rules.py). Under ep, experts held as
separate modules (passes/module_experts.py) go to `chunk.module_experts`, and experts computed
densely (passes/dense_experts.py: a bmm of [E, T, in] token slices by an [E, in, out]
parameter, or an einsum whose equation keeps the weight's experts, on any dim) are regions
with "offs" None, whose rows are the experts themselves.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.passes.cost import op_name
from threefold.ir.program import tf
from threefold.ir.stages import Partitioned
from threefold.errors import PlanError
from threefold.ops import families as fam
from threefold.passes.expert_match import _param_root, _val, expert_matmul, schema_arg, weight_chain  # noqa: F401 (schema_arg: read from here too)
from threefold.passes.module_experts import module_expert_groups
from threefold.passes.dense_experts import dense_expert_matmul, dense_groups
from threefold.passes.ep_rules import decide as region_decision
from threefold.passes.row_state import Rows


@stage_pass(needs=Partitioned)
def find_experts(prog: Partitioned) -> Partitioned:
    """Needs: chunk graphs. Guarantees: chunk.experts (expert regions) per chunk."""
    ep = getattr(prog.plan, "ep", 1)
    chunks = []
    found = 0
    refusals: list[str] = []
    for chunk in prog.chunks:
        regions = _regions(chunk.gm.graph, strict=ep > 1)
        if ep > 1:   # experts computed densely (passes/dense_experts.py), each on its rank under ep
            regions += _dense_regions(chunk.gm.graph, regions, refusals)
        found += len(regions)
        for r in regions:
            if ep > 1 and r["experts"] % ep:
                raise PlanError(f"plan ep={ep}: {r['name']} has {r['experts']} experts, which ep does not "
                                f"divide; choose an ep that divides {r['experts']}")
        groups = _module_groups(chunk.gm.graph, regions, refusals) if ep > 1 else []
        found += len(groups)
        for g in groups:
            if g["experts"] % ep:
                raise PlanError(f"plan ep={ep}: {g['name']} has {g['experts']} experts (separate modules), which "
                                f"ep does not divide; choose an ep that divides {g['experts']}")
        chunks.append(chunk.evolve(experts=tuple(regions), module_experts=tuple(groups)))
    if ep > 1 and not found and refusals:
        raise PlanError(refusals[0])
    if ep > 1 and not found:
        loop = next((d for d in (per_module_experts(c.gm.graph) for c in prog.chunks) if d), None)
        why = (f": its experts are {loop[0]} separate modules applied one by one ({loop[0]} linear layers of "
               f"weight {loop[1]} over pieces of one tensor at {loop[2]}), whose results are not combined by one "
               "stack, cat or sum, so ep cannot place them per rank"
               if loop else "")
        raise PlanError(f"plan ep={ep}: no expert computation found in {prog.name}{why} (ep splits grouped matmuls "
                        "over [experts, in, out] parameter weights with per-expert row offsets, and experts held as "
                        "separate modules whose results are stacked, concatenated or summed); drop ep (tp and "
                        "dp shard the experts as they are), or write each projection as one stacked [experts, in, "
                        "out] parameter applied with a grouped matmul to rows sorted by expert")
    if ep > 1 and getattr(prog.plan, "recompute", "none") != "none":
        raise PlanError(f"plan ep={ep} with recompute={prog.plan.recompute} is not supported yet "
                        "(an expert region inside a recomputed segment); use recompute=none with ep")
    return prog.evolve(chunks=tuple(chunks))


def _module_groups(graph: fx.Graph, regions: list[dict], refusals: list[str]) -> list[dict]:
    """Module expert groups (passes/module_experts.py) outside the grouped-matmul regions. A
    group ep cannot split exactly is left inline (exact, not split) and its reason kept: it
    is the PlanError when the model has no other expert computation."""
    groups = module_expert_groups(graph, refusals)
    grouped = {x for r in regions for x in r["nodes"]}
    return [g for g in groups if not grouped & set(g["nodes"])]


def per_module_experts(graph: fx.Graph):
    """(count, weight shape, module) where two or more linear layers of one weight shape, each
    its own parameter, read the pieces of one tensor (split / chunk / unbind, then getitem):
    experts held as a ModuleList and applied in a loop (soft-MoE's slots per expert); else None."""
    groups: dict = {}
    for n in graph.nodes:
        if n.op != "call_function" or op_name(n) != "linear":
            continue
        x, w = n.args[0], n.args[1]
        src = x
        while isinstance(src, fx.Node) and fam.family(op_name(src)) in ("view", "copy", "dim_move"):
            src = src.args[0]
        if not (isinstance(src, fx.Node) and src.target is operator.getitem
                and fam.family(op_name(src.args[0])) == "slicing"):
            continue
        if not (isinstance(w, fx.Node) and w.op == "placeholder" and _val(w) is not None):
            continue
        groups.setdefault((src.args[0], tuple(_val(w).shape)), set()).add(w)
    for (whole, shape), weights in groups.items():
        if len(weights) >= 2:
            return len(weights), list(shape), tf(whole).get("module") or "<top>"
    return None


def expert_regions(graph: fx.Graph) -> list[dict]:
    """The expert regions ep could run in any graph (the planner reads a traced SPEC's)."""
    return _regions(graph, strict=False)


def _regions(graph: fx.Graph, strict: bool) -> list[dict]:
    """The graph's expert regions. Without ep (strict=False) a region that ep could not run
    is simply not one: the ops stay inline, as traced."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    parts: dict[fx.Node, tuple] = {}
    for n in graph.nodes:
        m = expert_matmul(n)
        if m is not None:
            parts[n] = m
            by_offs.setdefault(m[3], []).append(n)
    out = []
    for offs, mms in by_offs.items():
        try:
            out.append(_region(graph, order, offs, mms, parts))
        except PlanError:
            if strict:
                raise
    return out


def _dense_regions(graph: fx.Graph, regions: list[dict], refusals: list[str]) -> list[dict]:
    """Regions of dense expert matmuls (passes/dense_experts.py) outside the grouped ones, with
    the experts as their rows and no offsets. One ep cannot run exactly is left inline (exact,
    not split) and its reason kept: it is the PlanError when nothing else is found."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    grouped = {x for r in regions for x in r["nodes"]}
    out = []
    for mms in dense_groups(graph):
        if any(m.name in grouped for m in mms):
            continue
        found = {m: dense_expert_matmul(m) for m in mms}
        if all(d.x_dim is None for d in found.values()):
            # only products of whole inputs by [E, ...] weights ('btc,hdc->bhtd'): per-head
            # projections of attention look the same; experts have at least one product of
            # their own slices (an MLP's second), so this is not taken for experts
            continue
        parts = {m: (d.x, d.w, d.param, None) for m, d in found.items()}
        try:
            out.append(_region(graph, order, None, mms, parts, found))
        except PlanError as err:
            refusals.append(str(err))
    return out


def _region(graph, order, offs, mms, parts, dense: dict | None = None) -> dict:
    """One region: grouped (rows sorted by expert, `offs` where each expert's end) or, with
    offs None, dense (`dense`: matmul -> DenseMatmul; the experts themselves are the rows, on
    the dim each dense matmul's operands say, passes/dense_experts.py)."""
    if dense:
        first = dense[mms[0]]
        rows = _val(first.w).shape[0]
        seeds = {d.x: d.x_dim for d in dense.values()}   # x_dim None: x read whole by every expert
        shared = {d.x for d in dense.values() if d.x_dim is None}
    else:
        rows = _val(parts[mms[0]][0]).shape[0]
        seeds, shared = None, set()
    experts = _val(offs).shape[0] if offs is not None else rows
    mm_set = set(mms)
    down = _reach(mms, lambda n: n.users)
    up = _reach(mms, lambda n: n.all_input_nodes)
    weights_of = {parts[m][1] for m in mms}
    nodes = {n for n in down & up if n.op == "call_function"} | mm_set
    nodes -= weights_of
    # asserts export leaves on a region value stay with it
    for n in list(nodes):
        for u in n.users:
            if not u.users and u.op == "call_function" and all(a in nodes for a in u.all_input_nodes):
                nodes.add(u)
    name = tf(mms[0]).get("module", "") or mms[0].name
    made = {m: d.out_dim for m, d in (dense or {}).items() if d.x_dim is None}
    states = _check_row_wise(name, sorted(nodes, key=order.get), rows, weights_of | {offs} - {None}, seeds, made)
    for m, d in (dense or {}).items():   # each expert's slice (or the whole x) meets that expert's weight
        if states.get(d.x) != (Rows(d.x_dim, 1) if d.x_dim is not None else None) \
                or states.get(m) != Rows(d.out_dim, 1):
            raise PlanError(f"expert region {name}: {op_name(m)} ({m.name}) multiplies the experts' weights with "
                            "slices that are not the experts' own (the experts sit on another dim of its "
                            "operand), so they cannot be computed on the experts' ranks; drop ep for this model")
    params = {}
    inputs: list[fx.Node] = []
    for n in sorted(nodes, key=order.get):
        for a in n.all_input_nodes:
            if a not in nodes and a not in inputs and a is not offs:
                inputs.append(a)
    row_inputs, weights, others = [], [], []
    for a in inputs:
        if a in weights_of:
            weights.append(a)
            p = _param_root(a)
            params[tf(p)["fqn"]] = experts
        elif _expert_dim(states.get(a), a, rows) is not None or a in shared:
            row_inputs.append(a)
        elif a.op == "placeholder" and tf(a).get("kind") in ("param", "buffer"):
            others.append(a)
        else:
            raise PlanError(f"expert region {name}: it reads {a.name}, which is neither its rows, an expert "
                            "weight nor a parameter; drop ep for this model")
    chains = {c for w in weights for c in weight_chain(w)}
    for c in chains:   # the parameter and its views feed only the region (under ep they hold E/ep experts)
        for u in c.users:
            if u not in chains and u not in nodes:
                fqn_node = _param_root(c) or c
                raise PlanError(f"expert weight {tf(fqn_node).get('fqn', c.name)} is also read by {op_name(u)} "
                                f"({tf(u).get('module', '') or u.name}) outside its expert matmuls; drop ep")
    ordered = sorted(nodes, key=order.get)
    last = order[ordered[-1]]
    outputs = [n for n in ordered if any(u not in nodes for u in n.users)]
    for n in outputs:
        if not isinstance(_val(n), torch.Tensor):
            raise PlanError(f"expert region {name}: {n.name} ({op_name(n)}) leaves the region as a tuple; "
                            "drop ep for this model")
    dims = {a.name: _expert_dim(states.get(a), a, rows) for a in row_inputs + ordered}
    if any(x not in shared and (dims[x.name] is None or offs is not None and dims[x.name] != 0)
           for x in row_inputs + outputs):
        # the runtime cuts each row input and output on its rows' dim (grouped: dim 0); a
        # shared input (dim None) goes whole to every rank
        raise PlanError(f"expert region {name}: its rows enter or leave it on a dim other than 0; "
                        "drop ep for this model")
    for n in outputs:
        for u in n.users:
            if u not in nodes and order[u] < last:
                raise PlanError(f"expert region {name}: {u.name} reads {n.name} before the region ends; drop ep")
    return {"name": name, "nodes": [n.name for n in ordered], "offs": offs.name if offs is not None else None,
            "rows": [a.name for a in row_inputs], "weights": [a.name for a in weights],
            "others": [a.name for a in others], "outputs": [n.name for n in outputs],
            "experts": int(experts), "params": params,
            # where each value holds its rows (dense: the experts), by node name
            "dims": dims}


def _reach(start, step) -> set:
    seen, todo = set(), list(start)
    while todo:
        n = todo.pop()
        for m in step(n):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _check_row_wise(name: str, nodes: list[fx.Node], rows: int, outside: set, seeds: dict | None = None,
                    made: dict | None = None) -> dict:
    """Every op of the region keeps each row's result a function of that row alone, in its
    place on one dim (ep's region rules, passes/ep_rules.py, over the batch-row rules, with
    the region's row inputs and expert matmul outputs as the rows): then any subset of rows,
    on any rank, computes what one process computes for them. Expert weights, offsets and
    parameters carry no rows. Returns the row state of every value the region reads or makes.

    Where a row input holds its rows: grouped regions (seeds None) on dim 0; dense ones on
    the dim its dense matmul says (`seeds`), or, for another input, the dim that broadcasting
    lines up with the rows of what it meets (a per-expert bias [E, 1, F] beside [E, T, F]).
    `made`: dense matmuls whose experts come from the weight alone (every expert on every
    token), matmul -> the experts' dim of its output."""
    inside = set(nodes)
    states: dict = {}
    for n in nodes:
        outer = [a for a in n.all_input_nodes if a not in inside and a not in outside and a not in states]
        for a in sorted(outer, key=lambda a: a not in (seeds or ())):   # the matmul operands first
            states[a] = _seed(a, n, states, rows, seeds)
        if made and n in made:   # the experts enter here, from the weight (checked by the caller)
            states[n] = Rows(made[n], 1)
            continue
        states[n], bad = region_decision(n, states, rows)
        if bad:
            raise PlanError(f"expert region {name}: {op_name(n)} ({tf(n).get('module', '') or n.name}) between "
                            f"the expert matmuls is not row-wise ({bad}), so its rows cannot be computed on the "
                            "experts' ranks; drop ep for this model")
    return states


def _seed(a: fx.Node, user: fx.Node, states: dict, rows: int, seeds: dict | None):
    """The row state of a value a region reads from outside (see _check_row_wise)."""
    v = _val(a)
    if not isinstance(v, torch.Tensor) or v.dim() < 1:
        return None
    if seeds is None:
        return Rows(0, 1) if v.shape[0] == rows else None
    if a in seeds:
        return Rows(seeds[a], 1) if seeds[a] is not None else None
    for b in user.all_input_nodes:   # right-aligned against an input whose rows are known
        s, vb = states.get(b), _val(b)
        if isinstance(s, Rows) and isinstance(vb, torch.Tensor):
            d = s.dim - vb.dim() + v.dim()
            if 0 <= d < v.dim() and v.shape[d] == rows:
                return Rows(d, 1)
    return None


def _expert_dim(state, a: fx.Node, rows: int) -> int | None:
    """The dim on which value `a` holds the region's rows, else None."""
    v = _val(a)
    if isinstance(state, Rows) and isinstance(v, torch.Tensor) and state.dim < v.dim() \
            and v.shape[state.dim] == rows:
        return state.dim
    return None
