"""Fusion pass: elementwise chains, softmax, norms and rotary regions -> fused-kernel nodes.

Runs on each rank's graph after partitioning. The steps, in order:
  1. split_linear_bias: linear(x, w, b) whose users are all elementwise becomes
     linear(x, w) + add(., b), so the bias joins the fused kernel (Megatron's skip_bias_add);
  2. row regions, anchored on an op that needs whole rows: softmax (growing backwards over
     its sole-user prologue: scale, explicit or causal mask), layer_norm, rms_norm (the ATen
     op or its decomposed x * rsqrt(mean(x^2) + eps) * w form), and rotary embeddings
     x * cos + cat(-x2, x1) * sin;
  3. elementwise regions: from the last unfused elementwise node backwards, absorbing
     producers while the region stays one kernel (same iteration shape, or a smaller value
     used only inside) and collapsing it leaves the graph acyclic;
  4. each region becomes one call_function node whose target is a FusedRegion
     (getitem nodes select when it has several outputs); the graph is re-sorted stably.
"""
from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.ir.program import tf
from threefold.ir.stages import Fused, Partitioned, copy_graph_module
from threefold.passes.fusion_patterns import (causal_form, fusible, half_to_float, last_dim, mask_pos, match_rms,
                                              match_rotary, users, val_of)
from threefold.passes.fusion_regions import ELEMENTWISE, FLOAT_DTYPES, FusedRegion, Op, Ref, RegionInput, classify
from threefold.runtime.kernels import MAX_ROW, pattern_of

SOFTMAX = ("aten.softmax.int", "aten._softmax.default")
NORMS = ("aten.layer_norm.default", "aten.rms_norm.default")


@stage_pass(needs=Partitioned, gives=Fused, guarantees=("kernels",))
def fuse(stage: Partitioned) -> Fused:
    """Replaces fusible regions in (copies of) each chunk graph by FusedRegion nodes and
    sets kernels {kernel_name: FusedRegion}. The chunks as they are when fusion is off."""
    if not fusion_enabled(stage):
        return stage.advance(Fused)
    names: dict = {}
    chunks, regions = [], []
    for c in stage.chunks:
        gm = copy_graph_module(c.gm)
        regions += fuse_graph(gm, names=names)
        chunks.append(c.evolve(gm=gm))
    kernels: dict[str, FusedRegion] = {}
    for r in regions:
        kernels.setdefault(r.kernel_name, r)
    note = (f"fusion: {len(regions)} regions, {len(kernels)} kernels"
            + (f" ({', '.join(sorted(kernels))})" if kernels else ""))
    return stage.advance(Fused, chunks=tuple(chunks), kernels=kernels, notes=stage.notes + (note,))


def fusion_enabled(prog) -> bool:
    """plan.fuse True/False decides; None means: on when the model's tensors are on CUDA."""
    if prog.plan.fuse is not None:
        return bool(prog.plan.fuse)
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in prog.state.values())


def fuse_graph(gm: fx.GraphModule, names: dict | None = None) -> list[FusedRegion]:
    """Rewrite `gm` in place: each fusible region becomes one FusedRegion node. `names` maps
    region signatures to kernel names; pass the same dict for every graph of one program."""
    names = {} if names is None else names
    graph = gm.graph
    split_linear_bias(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    finder = _Finder(graph, order)
    finder.find_row_regions()
    finder.find_elementwise_regions()
    regions = []
    for members, extra in finder.regions:
        region = _rewrite(graph, order, members, extra, names)
        if region is not None:
            regions.append(region)
    _stable_toposort(graph)
    graph.lint()
    gm.recompile()
    return regions


# ---- step 1: bias out of linear ------------------------------------------------------------
def split_linear_bias(graph: fx.Graph) -> None:
    """linear(x, w, b) with only elementwise users -> linear(x, w) + add(., b), so the bias add
    can join the users' fused kernel (the value keeps the linear's name)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) != "aten.linear.default":
            continue
        if len(node.args) < 3 or not isinstance(node.args[2], fx.Node) or not node.users:
            continue
        if not all(fusible(u) for u in node.users):
            continue
        x, w, b = node.args[:3]
        with graph.inserting_before(node):
            mm = graph.call_function(torch.ops.aten.linear.default, (x, w))
            add = graph.call_function(torch.ops.aten.add.Tensor, (mm, b))
        for new in (mm, add):
            new.meta.update({k: v for k, v in node.meta.items() if k != "tf"})
            new.meta["tf"] = dict(tf(node))
        node.replace_all_uses_with(add)
        name = node.name
        graph.erase_node(node)
        add.name = name            # the value keeps its name (chunk boundaries refer to it)


class _Finder:
    """Chooses regions (sets of nodes); `regions` holds (members, extra) in discovery order."""

    def __init__(self, graph: fx.Graph, order: dict):
        self.graph, self.order = graph, order
        self.region_of: dict[fx.Node, int] = {}
        self.regions: list[tuple[list[fx.Node], dict]] = []

    def _add(self, members, extra=None) -> None:
        rid = len(self.regions)
        for n in members:
            self.region_of[n] = rid
        self.regions.append((sorted(members, key=self.order.__getitem__), extra or {}))

    # -- step 2 ------------------------------------------------------------------------------
    def find_row_regions(self) -> None:
        for node in reversed(list(self.graph.nodes)):
            if node in self.region_of or node.op != "call_function":
                continue
            t = str(node.target)
            v = val_of(node)
            if v is None or v.dtype not in FLOAT_DTYPES or v.dim() == 0 or v.shape[-1] > MAX_ROW:
                continue
            if t in SOFTMAX and last_dim(node, node.args[1]) and not half_to_float(node):
                self._add(self._grow_softmax(node))
            elif t in NORMS and len(node.args[1]) == 1:
                self._add([node])
            elif t == "aten.mean.dim":
                members = match_rms(node)
                if members and not any(m in self.region_of for m in members):
                    self._add(members)
            elif t == "aten.cat.default":
                match = match_rotary(node)
                if match and not any(m in self.region_of for m in match[0]):
                    self._add(*match)

    def _grow_softmax(self, sm: fx.Node) -> list[fx.Node]:
        members = {sm}
        work = [sm]
        shape = val_of(sm).shape
        while work:
            n = work.pop()
            for i, a in enumerate(n.args):
                if i == mask_pos(n) and causal_form(a):
                    continue
                if (fusible(a) and a not in members and a not in self.region_of
                        and all(u in members for u in users(a))
                        and pattern_of(val_of(a).shape, shape) != "invalid"):
                    members.add(a)
                    work.append(a)
        return list(members)

    # -- step 3 ------------------------------------------------------------------------------
    def find_elementwise_regions(self) -> None:
        for root in reversed(list(self.graph.nodes)):
            if root in self.region_of or not fusible(root) or val_of(root).dtype == torch.bool:
                continue
            shape = val_of(root).shape
            members = {root}
            changed = True
            while changed:
                changed = False
                for n in sorted(members, key=self.order.__getitem__, reverse=True):
                    for a in n.all_input_nodes:
                        if a in members or a in self.region_of or not fusible(a):
                            continue
                        av = val_of(a)
                        pat = pattern_of(av.shape, shape)
                        if pat == "invalid":
                            continue
                        internal_only = all(u in members for u in users(a))
                        if (pat != "full" or av.dtype == torch.bool) and not internal_only:
                            continue
                        if self._creates_cycle(members | {a}):
                            continue
                        members.add(a)
                        changed = True
            if sum(1 for m in members if ELEMENTWISE.get(str(m.target)) != "clone") >= 2:
                self._add(list(members))

    def _creates_cycle(self, members: set) -> bool:
        """Would collapsing `members` (and every region already chosen) make a cycle?"""
        stack = [u for m in members for u in users(m) if u not in members]
        seen = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in members:
                return True
            rid = self.region_of.get(n)
            nexts = list(n.users)
            if rid is not None:   # a chosen region is one node: leave it through any member
                for m in self.regions[rid][0]:
                    seen.add(m)
                    nexts.extend(m.users)
            stack.extend(x for x in nexts if x not in seen)
        return False


# ---- step 4: rewrite -----------------------------------------------------------------------
def _rewrite(graph: fx.Graph, order: dict, members: list, extra: dict, names: dict):
    mset = set(members)
    outputs = [n for n in members if any(u not in mset for u in users(n))]
    if not outputs:
        return None
    shape = tuple(val_of(outputs[-1]).shape)
    rotate, skip = extra.get("rotate", {}), extra.get("skip", set())
    inputs: list[fx.Node] = []
    ops: list[Op] = []
    value: dict[fx.Node, Ref] = {}
    chains: list[fx.Node] = []

    def ref(a, pos: int, user: fx.Node):
        if isinstance(a, fx.Node):
            if a in value:
                return value[a]
            form = causal_form(a) if pos == mask_pos(user) else None
            like = [b for i, b in enumerate(user.args) if i != pos and isinstance(b, fx.Node)]
            if form is not None and like:
                chains.extend(form[3])
                ops.append(Op("causal_mask", (ref(like[0], -1, user),) + form[:3], dtype=torch.bool, node=a.name))
                value[a] = Ref("v", len(ops) - 1)
                return value[a]
            if a not in inputs:
                inputs.append(a)
            return Ref("x", inputs.index(a))
        if isinstance(a, (list, tuple)):
            return tuple(ref(b, pos, user) for b in a)
        return a

    for n in members:
        if n in skip:
            continue
        if n in rotate:
            ops.append(Op("rotate_half", (ref(rotate[n], 0, n),), dtype=val_of(n).dtype, node=n.name))
        else:
            args = tuple(ref(a, i, n) for i, a in enumerate(n.args))
            kwargs = tuple(sorted((k, ref(v, -1, n)) for k, v in n.kwargs.items()))
            ops.append(Op(str(n.target), args, kwargs, dtype=val_of(n).dtype, node=n.name))
        value[n] = Ref("v", len(ops) - 1)
    rins = []
    for a in inputs:
        av = val_of(a)
        pat = pattern_of(av.shape, shape)
        if pat == "invalid" or (av.dtype not in FLOAT_DTYPES and av.dtype != torch.bool):
            return None
        rins.append(RegionInput(av.dtype, pat, tuple(av.shape)))
    row = any(o.target not in ELEMENTWISE for o in ops)
    kind, base, desc = classify(ops, rins)
    region = FusedRegion(kernel_name="", kind=kind, source_nodes=[n.name for n in members], inputs=rins,
                         ops=ops, outputs=[value[o].index for o in outputs], shape=shape, row=row,
                         description=desc)
    region.kernel_name = _name(names, region.signature, base)
    region.__name__ = f"fused_{region.kernel_name}"

    last = members[-1]
    with graph.inserting_after(last):
        fused = graph.call_function(region, tuple(inputs))
    fused.meta.update({k: v for k, v in last.meta.items() if k in ("nn_module_stack", "stack_trace")})
    fused.meta["tf"] = {**tf(last), "fused": region.kernel_name}
    if len(outputs) == 1:
        fused.meta["val"] = val_of(outputs[0])
        outputs[0].replace_all_uses_with(fused, delete_user_cb=lambda u: u not in mset)
        renames = [(fused, outputs[0].name)]
    else:
        fused.meta["val"] = tuple(val_of(o) for o in outputs)
        prev, renames = fused, []
        for i, o in enumerate(outputs):
            with graph.inserting_after(prev):
                g = graph.call_function(operator.getitem, (fused, i))
            g.meta["val"] = val_of(o)
            g.meta["tf"] = dict(fused.meta["tf"])
            o.replace_all_uses_with(g, delete_user_cb=lambda u: u not in mset)
            prev = g
            renames.append((g, o.name))
    for n in reversed(members):
        for u in list(n.users):   # dtype asserts on values that no longer exist
            if u not in mset:
                graph.erase_node(u)
        graph.erase_node(n)
    for n in sorted(set(chains), key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
    for node, name in renames:    # outputs keep their names: chunk boundaries refer to them
        node.name = name
    return region


def _name(names: dict, signature: tuple, base: str) -> str:
    if signature in names:
        return names[signature]
    taken = set(names.values())
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    names[signature] = name
    return name


def _stable_toposort(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, keeping the original order otherwise."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    indeg = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n.name) for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    by_name = {n.name: n for n in nodes}
    result = []
    while ready:
        _, name = heapq.heappop(ready)
        n = by_name[name]
        result.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (index[u], u.name))
    if len(result) != len(nodes):
        raise RuntimeError("fusion made the graph cyclic; this is a bug in passes/fusion.py")
    for prev, n in zip(result, result[1:]):
        if prev.next is not n:
            prev.append(n)
