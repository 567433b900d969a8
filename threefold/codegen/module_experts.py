"""Code for experts held as separate modules (passes/module_experts.py).

Each member of a group becomes a method `_mexperts_<k>_<e>(inputs..., own parameters...)`
returning its result, and forward calls them all through ChunkModule.module_experts, which
under ep=N runs each on the rank holding its parameters (runtime/expert_modules.py) and with
ep=1 one after another. The call stands where every member's inputs exist; the members' ops
may be interleaved in the traced graph with the ops that combine them (a Python `sum` adds
expert 0's result before expert 1 runs), so forward's lines follow `emit_order`, a
topological order of the graph with each group as one step.
"""
from __future__ import annotations

import heapq

import torch.fx as fx

from threefold.codegen.lines import wrap_call


def emit_order(graph: fx.Graph, groups: list[dict]) -> list[fx.Node]:
    """The graph's nodes in an order where each group's nodes are consecutive (its last node
    first, standing for the group): graph order wherever the dependencies allow it."""
    if not groups:
        return list(graph.nodes)
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    item = {n: n for n in nodes}
    for g in groups:
        members = [by_name[x] for x in g["nodes"]]
        head = max(members, key=index.get)
        for m in members:
            item[m] = head
    deps = {n: set() for n in set(item.values())}
    for n in nodes:
        for a in n.all_input_nodes:
            if item[a] is not item[n]:
                deps[item[n]].add(item[a])
    users = {n: [] for n in deps}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    first = {}
    for n in nodes:
        first.setdefault(item[n], index[n])
    ready = [(first[n], index[n], n) for n, ds in deps.items() if not ds]
    heapq.heapify(ready)
    waiting = {n: len(ds) for n, ds in deps.items()}
    out = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (first[u], index[u], u))
    if len(out) != len(deps):
        raise RuntimeError("module experts: the graph has no order with each group in one step")
    return out


def module_experts_call(writer, graph: fx.Graph, group: dict) -> list[str]:
    """The members' methods (added to writer.segment_methods) and forward's call of them."""
    by_name = {n.name: n for n in graph.nodes}
    names = writer.names
    fns, inputs, params = [], [], []
    k = len(writer.segment_methods)
    for e, m in enumerate(group["members"]):
        nodes = [by_name[x] for x in m["nodes"]]
        args = [by_name[x] for x in m["inputs"]] + [by_name[x] for x in m["params"]]
        method = f"_mexperts_{k}_{e}"
        outer_device = writer.uses_device
        writer.uses_device = False
        body = wrap_call(f"    def {method}(", ["self"] + [names[a] for a in args], "", "        ", "):")
        body.append(f"        # {group['name']}: expert {e} of {group['experts']} (its rank's under ep)")
        dev_line = len(body)
        for n in nodes:
            body += writer._line(n)
        body.append(f"        return {names[by_name[m['output']]]}")
        if writer.uses_device:
            body.insert(dev_line, "        dev = self.device")
        writer.uses_device = outer_device
        writer.segment_methods.append(body)
        fns.append(f"self.{method}")
        inputs.append("(" + "".join(names[by_name[x]] + ", " for x in m["inputs"]) + ")")
        params.append("(" + "".join(names[by_name[x]] + ", " for x in m["params"]) + ")")
    outputs = [names[by_name[m["output"]]] for m in group["members"]]

    def tup(items):
        return "(" + "".join(i + ", " for i in items) + ")"
    return ([f"        # experts {group['name']}: {group['experts']} separate modules, combined by "
             f"{group['combine']} below (under ep: each on the rank holding it, inputs and results by all-to-all)"]
            + wrap_call(f"        {''.join(o + ', ' for o in outputs)}= self.module_experts(",
                        [tup(fns), tup(inputs), tup(params)], "", "        "))
