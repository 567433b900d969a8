"""Score biases computed from positions and parameters (T5's learned relative-position buckets),
under context parallelism.

An attention's additive operand is split into leaves over `+`; a leaf that reads a parameter
but no user input, depends on an `arange` over the local sequence length n and ends in
[..., n, n] is a *position bias*: some function of (query positions, key positions) and
parameters, whatever ops compute it. Which arange numbers the queries and which the keys is
found by data flow, by evaluating the subgraph: an arange whose permutation permutes the
bias's rows holds query positions, one that permutes its columns key positions.

The subgraph is then copied once per ring step, query aranges replaced by this rank's global
positions and key aranges by those of the keys that visit at that step
(runtime/cp_bias.ring_positions); ring attention adds block `step` to that step's scores and
returns its gradient, so autograd sums the blocks' gradients into the parameters read (the
embedding table). Memory: cp blocks of [..., n, n] = [..., n, S], computed once where the
model computes the bias once (T5 shares it across layers); bytes moved: none beyond the ring's
K/V. Before the rewrite the blocks are checked against the bias evaluated over the whole
sequence (a bias that depends on the length, not only on positions, is a PlanError).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from threefold.errors import PlanError
from threefold.ir.program import tf, upstream
from threefold.ops.families import op_name
from threefold.passes.cp_masks import free, input_free, param_free
from threefold.runtime import cp_bias
from threefold.runtime.cp_ops import block_positions
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")
_WHOLE_CHECK = 1 << 24   # evaluate the bias over the whole sequence when it has at most this many elements


def is_position_bias(node, n: int) -> bool:
    """Ends in [..., n, n], reads no user input, and either reads a parameter and an arange(n)
    or is a constant the mask code cannot read because tp slices it (T5's zero bias of its
    cross attention, [1, heads, n, n], with the heads sharded): the same for every block."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dim() >= 2 and tuple(val.shape[-2:]) == (n, n)
            and input_free(node)):
        return False
    if not free(node):
        return bool(_aranges(node, n))
    return not _aranges(node, n) and any(isinstance(a, GroupRef) for x in upstream(node) for a in x.args)


def carries_position_bias(node, n: int) -> bool:
    """An additive score operand made, over `+`, of position biases and masks (no parameter),
    at least one of them a position bias (T5: bias + padding mask)."""
    leaves = _add_leaves(node, n)
    return any(is_position_bias(x, n) for x in leaves) \
        and all(is_position_bias(x, n) or param_free(x) for x in leaves)


def take_position_biases(masks: list, stage, n: int, cache: dict, last: fx.Node) -> tuple[list, list | None]:
    """(masks without their position-bias leaves, the summed per-ring-step bias blocks or
    None). `cache`: bias node -> its blocks, so a bias shared by every layer is copied once;
    `last`: the attention's output (its leading dims are the ring's)."""
    rest, found = [], []
    for kind, m in masks:
        if kind != "add" or not carries_position_bias(m, n):
            rest.append((kind, m))
            continue
        for leaf in _add_leaves(m, n):
            if is_position_bias(leaf, n):
                found.append(leaf)
            else:
                rest.append(("add", leaf))
    if not found:
        return masks, None
    lead = tuple(last.meta["val"].shape[:-2])
    for b in found:
        mine = tuple(b.meta["val"].shape[:-2])
        if len(mine) > len(lead) or _broadcast(mine, lead) != lead:
            raise PlanError(f"cp: the position bias of attention at {tf(b).get('module') or '<top>'} has leading "
                            f"dims {mine} that do not broadcast to the attention's {lead} (scores reshaped between "
                            "the bias and the softmax?); use cp=1")
    per_leaf = [cache[b] if b in cache else cache.setdefault(b, _blocks(b, stage, n)) for b in found]
    if len(per_leaf) == 1:
        return rest, per_leaf[0]
    summed = []
    for step, parts in enumerate(zip(*per_leaf)):
        key = ("sum", tuple(found), step)
        if key not in cache:
            graph, total = parts[0].graph, parts[0]
            for p in parts[1:]:
                with graph.inserting_after(max(total, p, key=_order(graph))):
                    new = graph.call_function(torch.ops.aten.add.Tensor, (total, p))
                new.meta = {"val": total.meta["val"] + p.meta["val"], "tf": dict(tf(p))}
                total = new
            cache[key] = total
        summed.append(cache[key])
    return rest, summed


def _broadcast(a: tuple, b: tuple):
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def _order(graph: fx.Graph):
    index = {x: i for i, x in enumerate(graph.nodes)}
    return lambda x: index[x]


def _add_leaves(node, n: int) -> list:
    if isinstance(node, fx.Node) and not is_position_bias(node, n) and op_name(node) == "add" \
            and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        return _add_leaves(node.args[0], n) + _add_leaves(node.args[1], n)
    return [node]


def _arange_of(node: fx.Node, n: int) -> bool:
    """arange(n) / arange(0, n[, 1]): the local positions as traced."""
    if node.op != "call_function" or op_name(node) != "arange":
        return False
    args, overload = list(node.args), node.target._overloadname
    bounds = {"default": lambda: (0, args[0], 1), "start": lambda: (args[0], args[1], 1),
              "start_step": lambda: tuple(args[:3])}.get(overload)
    return bounds is not None and bounds() == (0, n, 1)


def _ancestors(node: fx.Node) -> list:
    """upstream(node) in graph order."""
    seen = upstream(node)
    return [x for x in node.graph.nodes if x in seen]


def _aranges(node: fx.Node, n: int) -> list:
    up = upstream(node)
    return [x for x in _ancestors(node) if _arange_of(x, n)] if any(_arange_of(x, n) for x in up) else []


# -- evaluation at compile time ----------------------------------------------------------------

def _run(node: fx.Node, stage, overrides: dict, lengths: dict | None = None) -> torch.Tensor:
    """node's value from the stage's parameters and buffers, the nodes in `overrides` replaced;
    integer arguments in `lengths` (the traced length n) replaced by their value there (in a
    shape, only its last two dims: a leading dim equal to n is heads or batch). A tp op (it
    takes a process group) is read as the identity: its value over every tp rank, the same
    reading in every evaluation compared, and it acts on heads or features, not positions."""
    env, lengths = dict(overrides), lengths or {}

    def sized(a):
        if isinstance(a, (list, tuple)) and a and all(type(v) is int for v in a):
            return type(a)(v if i < len(a) - 2 else lengths.get(v, v) for i, v in enumerate(a))
        if isinstance(a, (list, tuple)):
            return type(a)(sized(v) for v in a)
        return lengths.get(a, a) if type(a) is int else a

    for x in _ancestors(node):
        if x in env:
            continue
        if x.op == "placeholder":
            env[x] = stage.state[tf(x)["fqn"]]
        elif x.op == "get_attr":
            env[x] = getattr(x.graph.owning_module, x.target)
        else:
            args = sized(map_arg(x.args, lambda a: env[a]))
            kwargs = {k: sized(v) for k, v in map_arg(x.kwargs, lambda a: env[a]).items()}
            if any(isinstance(a, GroupRef) for a in list(args) + list(kwargs.values())):
                env[x] = args[0]
                continue
            env[x] = x.target(*args, **kwargs)
    return env[node]


def _roles(bias: fx.Node, stage, n: int, m: int, where: str) -> tuple[list, list]:
    """(query aranges, key aranges) of the bias, by permuting each and seeing which of the
    bias's dims follows (a cyclic shift and a random permutation: a bias symmetric under one
    is rarely under both). One that both dims follow under every permutation (a symmetric
    bias at a tiny length) takes the role still missing; _check then confirms the reading.
    Evaluated at local length m (see _analysis_length)."""
    queries, keys, either = [], [], []
    perms = [torch.roll(torch.arange(m), 1), torch.randperm(m, generator=torch.Generator().manual_seed(0))]
    perms = [p for p in perms if not torch.equal(p, torch.arange(m))]
    lengths = {n: m}
    with torch.no_grad():
        try:
            base = _run(bias, stage, {}, lengths)
        except Exception as exc:
            raise PlanError(f"cp: the position bias of {where} cannot be evaluated at compile time "
                            f"({type(exc).__name__}); use cp=1") from None
        for a in _aranges(bias, n):
            ar = _run(a, stage, {}, lengths)
            seen = set()
            for perm in perms:
                out = _run(bias, stage, {a: ar[perm]}, lengths)
                rows = torch.equal(out, base.index_select(-2, perm))
                cols = torch.equal(out, base.index_select(-1, perm))
                seen.add("none" if torch.equal(out, base) else "both" if rows and cols else
                         "query" if rows else "key" if cols else "mixed")
            if len(seen) > 1:
                seen.discard("both")
            if seen == {"query"}:
                queries.append(a)
            elif seen == {"key"}:
                keys.append(a)
            elif seen == {"both"}:
                either.append(a)
            elif seen != {"none"}:
                raise PlanError(f"cp: the position bias of {where} uses one arange for both query and key "
                                "positions (or mixes them): cp cannot tell which positions to give it; "
                                "use cp=1")
    for a in either:
        (queries if keys and not queries else keys).append(a)
    if queries and not keys:
        raise PlanError(f"cp: the position bias of {where} does not depend on key positions as cp can "
                        "tell; use cp=1")
    return queries, keys


def _analysis_length(bias: fx.Node, n: int, cp: int) -> int:
    """The local length at which to read the bias at compile time: n while the bias over the
    whole sequence has at most _WHOLE_CHECK elements, else a smaller even m such that neither
    m nor cp*m is an integer the subgraph reads (a coincidence would change its meaning), as
    the mask code reads masks at s and s/cp (passes/cp_masks.py); the smallest such m if
    none keeps within the budget."""
    lead = bias.meta["val"].shape[:-2].numel()
    if lead * (cp * n) ** 2 <= _WHOLE_CHECK:
        return n
    taken: set = set()
    for x in _ancestors(bias):
        stack = list(x.args) + list(x.kwargs.values())
        while stack:
            a = stack.pop()
            if isinstance(a, (list, tuple)):
                stack.extend(a)
            elif type(a) is int:
                taken.add(a)
    fits = [m for m in range(2 * cp + 6, n, 2) if m not in taken and cp * m not in taken]
    return fits[0] if fits else n


def _check(bias: fx.Node, stage, n: int, m: int, queries: list, keys: list, where: str) -> None:
    """Each (rank, step) block as the copies compute it equals the bias over the whole
    sequence at those positions, read at local length m (see _analysis_length). This is what
    catches a position-dependent value that is not an arange (a tril(ones(n, n)) would be
    copied as it is into every block)."""
    cp, s = stage.plan.cp, m * stage.plan.cp
    with torch.no_grad():
        try:
            whole = torch.as_tensor(_run(bias, stage, {}, {n: s}))
        except Exception as exc:
            raise PlanError(f"cp: the position bias of {where} cannot be evaluated over the whole sequence "
                            f"({type(exc).__name__}; does another size equal the local length {n}?); use "
                            "another sequence length or cp=1") from None
        for r in range(cp):
            qpos = block_positions(m, cp, r)
            for step in range(cp):
                kpos = block_positions(m, cp, (r - step) % cp)
                env = {a: qpos.to(a.meta["val"].dtype) for a in queries}
                env.update({a: kpos.to(a.meta["val"].dtype) for a in keys})
                got = _run(bias, stage, env, {n: m})
                want = whole.index_select(-2, qpos).index_select(-1, kpos)
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
                    raise PlanError(f"cp: the position bias of {where} over a block of positions differs from "
                                    "the bias over the whole sequence at those positions (it depends on the "
                                    "length, not only on positions); use cp=1")


def _blocks(bias: fx.Node, stage, n: int) -> list:
    """The bias's subgraph copied once per ring step at this rank's global query positions and
    that step's key positions; the nodes that read only query positions are shared."""
    where = f"attention at {tf(bias).get('module') or '<top>'}"
    if stage.is_meta:
        raise PlanError(f"cp: the position bias of {where} cannot be checked on the meta device; compile with "
                        "real weights or use cp=1")
    _one_arange_per_use(bias, n)
    m = _analysis_length(bias, n, stage.plan.cp)
    try:
        queries, keys = _roles(bias, stage, n, m, where)
    except Exception:
        if m == n:
            raise
        m = n   # the shorter reading may meet a size it should not change: read at n
        queries, keys = _roles(bias, stage, n, m, where)
    _check(bias, stage, n, m, queries, keys, where)
    if not queries and not keys:   # no positions read, and checked the same over the whole sequence
        return [bias] * stage.plan.cp
    graph = bias.graph
    nodes = _ancestors(bias)
    reads_keys = set(keys)
    for x in nodes:
        if any(a in reads_keys for a in x.all_input_nodes):
            reads_keys.add(x)
    reads_queries = set(queries)
    for x in nodes:
        if any(a in reads_queries for a in x.all_input_nodes):
            reads_queries.add(x)

    def positions(a: fx.Node, step: int) -> fx.Node:
        kwargs = {k: v for k, v in a.kwargs.items() if k in ("dtype", "device")}
        p = graph.call_function(cp_bias.ring_positions, (n, step, CP), kwargs)
        p.meta = {"val": a.meta["val"], "tf": dict(tf(a))}
        return p

    out, shared = [], {}
    with graph.inserting_before(bias.next):   # in order, before any attention reads it
        for a in queries:
            shared[a] = positions(a, 0)
        for x in nodes:   # what reads query positions but no key positions: once for every step
            if x in reads_queries and x not in reads_keys and x not in shared:
                shared[x] = _copy(graph, x, shared)
        for step in range(stage.plan.cp):
            env = dict(shared)
            for a in keys:
                env[a] = positions(a, step)
            for x in nodes:
                if x in reads_keys and x not in env:
                    env[x] = _copy(graph, x, env)
            out.append(env[bias])
    return out


def _one_arange_per_use(bias: fx.Node, n: int) -> None:
    """An arange read by several ops inside the bias (`i[None, :] - i[:, None]`) gets one copy
    per reader, so each copy can be told query or key positions."""
    inside = upstream(bias)
    for a in _aranges(bias, n):
        readers = [u for u in a.users if u in inside]
        for u in readers[1:]:
            with a.graph.inserting_after(a):
                twin = a.graph.node_copy(a)
            twin.meta = dict(a.meta)
            u.replace_input_with(a, twin)


def _copy(graph: fx.Graph, x: fx.Node, env: dict) -> fx.Node:
    new = graph.node_copy(x, lambda a: env.get(a, a))
    new.meta = dict(x.meta)
    new.meta["tf"] = dict(tf(x))
    return new
