"""Emit one readable Python module per chunk, shared by every tp rank.

The module defines a `ChunkModule` subclass whose forward is the chunk's ATen ops written
out one per line, with the source graph's value names. Parameters are read by FQN at the
top of forward. The tp rank is a runtime value (the module's tp group, bound by the
runtime), so the text does not depend on it; each tp rank loads its own weight shard.
A header records the plan, the chunk's pipeline stage, the source modules the chunk
covers, and a content hash of everything below the header.
"""
from __future__ import annotations

import hashlib
import keyword
import operator
from collections import Counter

import torch
import torch.fx as fx

from threefold.codegen.backward_split import deferred_line, deferred_ops, splits_backward
from threefold.codegen.lines import annotation, wrap_call
from threefold.codegen.module_experts import emit_order, module_experts_call
from threefold.ir.program import tf
from threefold.ir.stages import Chunk, Program
from threefold.ops import families as fam
from threefold.runtime.mesh import chunk_layout, stage_of

_HASH_LINE = "# content-hash: "


def generate_module(prog: Program, chunk: Chunk) -> str:
    gm = chunk.gm
    assert gm is not None, "run extract_chunks before codegen"
    body = _ClassWriter(prog, chunk, gm).write()
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    plan = prog.plan
    stage = stage_of(chunk.index, plan.pp, chunk_layout(plan.schedule))
    header = [
        f'"""threefold generated code for {prog.name}: chunk {chunk.index} of {len(prog.chunks)}.',
        "",
        f"plan:    {plan}",
        f"rank:    pipeline stage {stage} (model chunk {chunk.index}, virtual {chunk.index // plan.pp}),"
        f" every tp rank of {plan.tp} (the tp rank is its tp group's, at run time)",
        f"covers:  {_covers(gm)}",
        "Generated from the traced graph; edit the model, not this file.",
        '"""',
        f"{_HASH_LINE}{digest}",
    ]
    return "\n".join(header) + "\n" + body


def content_hash(source: str) -> str:
    for line in source.splitlines():
        if line.startswith(_HASH_LINE):
            return line[len(_HASH_LINE):]
    return ""


def _covers(gm: fx.GraphModule) -> str:
    """Top-two-level module paths the chunk's ops came from, in order, compressed."""
    seen: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or tf(node).get("recomputed"):
            continue
        parts = tf(node).get("module", "").split(".")
        path = ".".join(parts[:2]) if parts and parts[0] else "<top>"
        if not seen or seen[-1] != path:
            if path not in seen:
                seen.append(path)
    if len(seen) > 12:
        seen = seen[:5] + ["..."] + seen[-5:]
    return ", ".join(seen)


class _ClassWriter:
    def __init__(self, prog: Program, chunk: Chunk, gm: fx.GraphModule):
        self.prog, self.chunk, self.gm = prog, chunk, gm
        self.names: dict[fx.Node, str] = {}
        self.imports: set[str] = set()

    def write(self) -> str:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        args = [n for n in placeholders if tf(n)["kind"] in ("boundary", "input")]
        state = [n for n in placeholders if tf(n)["kind"] in ("param", "buffer")]
        self.segment_methods: list[list[str]] = []
        lines = self._method("forward", self.gm.graph)
        for method in self.segment_methods:   # recomputed segments (passes/recompute.py)
            lines += [""] + method
        den = self.prog.loss_denominator
        is_last = self.chunk.index == len(self.prog.chunks) - 1
        den_inputs = None
        if is_last and den is not None:
            # The loss's denominator (passes/loss_form.py): the runtime sums it over every
            # microbatch and dp rank before the first backward of a step.
            lines += [""] + self._method("loss_denominator", den.graph)
            den_inputs = [tf(n)["input_index"] for n in den.graph.nodes
                          if n.op == "placeholder" and tf(n)["kind"] == "input"]
        outputs_attr = None
        if is_last and self.prog.has_loss and self.prog.model_outputs:
            # pm(x) on a model compiled with a loss: the model's outputs, whole (see
            # codegen/model_outputs.py); forward (training) is left exactly as it is
            # lazy: start-up: codegen.model_outputs loads only on this path
            from threefold.codegen.model_outputs import model_outputs_graph
            g = model_outputs_graph(self.gm, self.prog.model_outputs, self.prog.model_output_meta,
                                    self.prog.plan.tp)
            if not isinstance(g, str):
                before = len(self.segment_methods)
                lines += [""] + self._method("model_outputs", g)
                for method in self.segment_methods[before:]:   # its expert regions' methods
                    lines += [""] + method
                outputs_attr = "    MODEL_OUTPUT_INPUTS = " + repr(
                    [tf(n)["input_index"] for n in g.nodes if n.op == "placeholder" and tf(n)["kind"] == "input"])

        def spec(n):
            val = n.meta["val"]
            return f"({list(val.shape)}, {str(val.dtype).replace('torch.', '')!r})"

        params = [n for n in state if tf(n)["kind"] == "param"]
        buffers = [n for n in state if tf(n)["kind"] == "buffer"]
        cls = [f"class Chunk{self.chunk.index}(ChunkModule):"]
        cls.append("    PARAMS = {" + "".join(f"\n        {tf(n)['fqn']!r}: {spec(n)}," for n in params)
                   + ("\n    }" if params else "}"))
        frozen = [tf(n)["fqn"] for n in params if tf(n).get("frozen")]
        experts = {f: e for r in self.chunk.experts for f, e in r["params"].items()}
        if experts:  # expert weights: under ep=N each rank keeps E/N of them (runtime/experts.py)
            cls.append(f"    EXPERTS = {experts!r}")
        owned = {f: [e, g["experts"]] for g in self.chunk.module_experts for f, e in g["owned"].items()}
        if owned:  # experts held as separate modules: FQN -> [expert, experts]; under ep only its rank keeps it
            cls.append(f"    EXPERT_MODULES = {owned!r}")
        if frozen:  # requires_grad=False in the model: no gradient, no optimizer state
            cls.append(f"    FROZEN = {frozen!r}")
        cls.append("    BUFFERS = {" + "".join(f"\n        {tf(n)['fqn']!r}: {spec(n)}," for n in buffers)
                   + ("\n    }" if buffers else "}"))
        cls.append(f"    INPUTS = {[n.name for n in args if tf(n)['kind'] == 'boundary']!r}")
        cls.append(f"    USER_INPUTS = {[tf(n)['input_index'] for n in args if tf(n)['kind'] == 'input']!r}")
        if den_inputs is not None:
            cls.append(f"    DENOMINATOR_INPUTS = {den_inputs!r}")
        cls.append(f"    OUTPUTS = {self.chunk.output_names!r}")
        if outputs_attr:
            cls.append(outputs_attr)
        if self._gathers_sequence():
            cls.append("    # sequence parallelism: backward all-gathers the shards again (runtime/saved_shards.py)")
            cls.append("    SAVES_SHARDS = True")
        cls.append("")
        imports = ["import torch", "", "from threefold.runtime.module import ChunkModule"]
        imports += sorted(self.imports)
        return "\n".join(imports + ["", "aten = torch.ops.aten", "", ""] + cls + lines) + "\n"

    def _gathers_sequence(self) -> bool:
        from threefold.runtime import tp_ops   # lazy: start-up: runtime.tp_ops loads only on this path
        return any(n.op == "call_function" and n.target is tp_ops.all_gather_seq for n in self.gm.graph.nodes)

    def _method(self, name: str, graph: fx.Graph) -> list[str]:
        """`def name(self, <boundary and user inputs>)`: the graph's ops one per line."""
        self.names = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        args = [n for n in placeholders if tf(n)["kind"] in ("boundary", "input")]
        state = [n for n in placeholders if tf(n)["kind"] in ("param", "buffer")]
        for n in placeholders:
            self.names[n] = _ident(n.name if tf(n)["kind"] in ("boundary", "input")
                                   else "p_" + tf(n)["fqn"].replace(".", "_"))
        self.names.update(value_names(graph, set(self.names.values())))
        lines = [f"    def {name}(self, {', '.join(self.names[n] for n in args)}):"]
        self.uses_device = False
        dev_line = len(lines)
        for n in state:
            lines.append(f"        {self.names[n]} = self.p({tf(n)['fqn']!r})")
            if name == "forward" and tf(n).get("once_per_step"):
                lines.append(f"        {self.names[n]} = self.step_start({tf(n)['fqn']!r}, {self.names[n]})"
                             "  # written below from no batch data: once per step")
        lines += self._prologue(graph, args)
        out_line = None
        segments = list(self.chunk.recompute) if name == "forward" else []
        first = {seg["nodes"][0]: seg for seg in segments}
        in_segment = {x for seg in segments for x in seg["nodes"]}
        # zero-bubble schedules: ops reading weights leave their weight gradients to W
        deferred = (deferred_ops(graph, in_segment) if name == "forward" and splits_backward(self.prog.plan)
                    else {})
        self.unit_starts = self._unit_starts() if name != "loss_denominator" else {}
        # expert regions (passes/experts.py): in forward, and in model_outputs (pm(x)), whose
        # graph copies forward's ops by name (an assert no output needs may be left out)
        present = {n.name for n in graph.nodes}
        regions = [r for r in self.chunk.experts if r["nodes"][-1] in present or
                   any(o in present for o in r["outputs"])] if name in ("forward", "model_outputs") else []
        region_last = {[x for x in r["nodes"] if x in present][-1]: r for r in regions}
        in_region = {x for r in regions for x in r["nodes"]}
        # experts held as separate modules (passes/module_experts.py): one step each
        groups = [g for g in self.chunk.module_experts if all(x in present for x in g["nodes"])] \
            if name in ("forward", "model_outputs") else []
        index = {n.name: i for i, n in enumerate(graph.nodes)}
        group_at = {max(g["nodes"], key=index.get): g for g in groups}   # emit_order's step for the group
        in_group = {x for g in groups for x in g["nodes"]}
        for node in emit_order(graph, groups):
            if node.name in group_at:
                lines += module_experts_call(self, graph, group_at[node.name])
            elif node.name in in_group:
                continue
            elif node.name in region_last:
                lines += self._experts_call(graph, region_last[node.name])
            elif node.name in in_region:
                continue
            elif node.name in first:
                for n in first[node.name]["nodes"]:
                    lines += self._unit_line(n)
                lines += self._segment_call(graph, first[node.name])
            elif node.name in in_segment:
                continue
            elif node in deferred:
                lines += self._unit_line(node.name) + deferred_line(self, node, deferred[node])
            elif node.op == "call_function":
                lines += self._unit_line(node.name) + self._line(node)
            elif node.op == "output":
                outs = node.args[0]
                out_line = "        return (" + "".join(self._arg(o) + ", " for o in outs) + ")"
                if name == "forward" and [self._arg(o) for o in outs] != self.chunk.output_names:
                    out_line += f"  # OUTPUTS {self.chunk.output_names}"
        lines.append(out_line)
        if self.uses_device:  # ops that create tensors run on the module's own device
            lines.insert(dev_line, "        dev = self.device")
        return lines

    def _segment_call(self, graph: fx.Graph, seg: dict) -> list[str]:
        """A recomputed segment: its ops become a method `_recompute_<k>`, and forward calls
        it through ChunkModule.recompute (torch.utils.checkpoint: autograd keeps only the
        segment's inputs and runs the method again in backward, with the same random seeds)."""
        nodes = [n for n in graph.nodes if n.name in set(seg["nodes"])]
        inside = set(nodes)
        inputs: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        method = f"_recompute_{len(self.segment_methods)}"
        outer_device = self.uses_device
        self.uses_device = False
        body = wrap_call(f"    def {method}(", ["self"] + [self.names[a] for a in inputs], "", "        ", "):")
        body.append(f"        # {seg['name']}: {seg['why']}")
        dev_line = len(body)
        for n in nodes:   # named and annotated like forward's own lines
            body += self._unit_line(n.name) + self._line(n)
        body.append("        return (" + "".join(self.names[o] + ", " for o in outputs) + ")")
        if self.uses_device:
            body.insert(dev_line, "        dev = self.device")
        self.uses_device = outer_device
        self.segment_methods.append(body)
        return ([f"        # recomputed in backward: {seg['name']} ({len(nodes)} ops; {seg['why']})"]
                + wrap_call(f"        {''.join(self.names[o] + ', ' for o in outputs)}= self.recompute("
                            f"self.{method}" + (", " if inputs else ""), [self.names[a] for a in inputs],
                            "", "        "))

    def _experts_call(self, graph: fx.Graph, region: dict) -> list[str]:
        """An expert region (passes/experts.py): its row-wise ops become a method
        `_experts_<k>(offs, rows..., expert weights..., others...)`, and forward calls it
        through ChunkModule.experts, which under ep=N runs it on the ranks holding the rows'
        experts (all-to-all there and back, runtime/experts.py) and with ep=1 directly."""
        by_name = {n.name: n for n in graph.nodes}
        nodes = [by_name[x] for x in region["nodes"] if x in by_name]
        offs = by_name[region["offs"]] if region["offs"] else None   # None: dense (passes/dense_experts.py)
        groups = [[by_name[x] for x in region[k]] for k in ("rows", "weights", "others")]
        outputs = [by_name[x] for x in region["outputs"] if x in by_name]
        method = f"_experts_{len(self.segment_methods)}"
        outer_device = self.uses_device
        self.uses_device = False
        params = ([self.names[offs]] if offs is not None else []) + [self.names[a] for g in groups for a in g]
        body = wrap_call(f"    def {method}(", ["self"] + params, "", "        ", "):")
        body.append(f"        # {region['name']}: {region['experts']} experts (this rank's under ep), "
                    + ("rows sorted by expert, offsets local" if offs is not None else "one token slice per expert"))
        dev_line = len(body)
        for n in nodes:
            body += self._line(n)
        body.append("        return (" + "".join(self.names[o] + ", " for o in outputs) + ")")
        if self.uses_device:
            body.insert(dev_line, "        dev = self.device")
        self.uses_device = outer_device
        self.segment_methods.append(body)

        def tup(g):
            return "(" + "".join(self.names[a] + ", " for a in g) + ")"
        # the experts' dim of each row input and output, written only where one is not dim 0
        # (an einsum's experts, 'becd,edf->becf'; None: an input every expert reads whole,
        # passes/dense_experts.py)
        dims = region.get("dims", {})
        row_dims = [dims.get(a.name, 0) for a in groups[0]]
        out_dims = [dims.get(o.name) or 0 for o in outputs]
        dim_arg = ([f"dims=({tuple(row_dims)!r}, {tuple(out_dims)!r})"]
                   if any(d != 0 for d in row_dims + out_dims) else [])
        return ([f"        # experts {region['name']}: {len(nodes)} ops on the rows' experts' ranks "
                 "(under ep: all-to-all there and back)"]
                + wrap_call(f"        {''.join(self.names[o] + ', ' for o in outputs)}= self.experts(",
                            [f"self.{method}", str(region["experts"]), self.names[offs] if offs is not None else "None"]
                            + [tup(g) for g in groups] + dim_arg, "", "        "))

    def _unit_starts(self) -> dict[str, tuple[int, str]]:
        """zero=3: first node of each layer unit -> (unit index, layer) (passes/shard_units.py)."""
        if self.prog.plan.zero < 3:
            return {}
        return {u.first: (k, u.name) for k, u in enumerate(self.chunk.units) if k > 0 and u.first}

    def _unit_line(self, node_name: str) -> list[str]:
        hit = self.unit_starts.get(node_name)
        if hit is None:
            return []
        k, layer = hit
        return [f"        self.unit({k})  # zero=3: {layer}'s parameters all-gathered here (the next layer's prefetched)"]

    def _prologue(self, graph: fx.Graph, args: list[fx.Node]) -> list[str]:
        """Copies of received and batch tensors that an op of this method writes in place
        (`h += skip` on a received value): received tensors are autograd leaves, which may
        not be written in place, and batch tensors are shared by every microbatch."""
        lines = []
        for n in _mutated_inputs(graph, args):
            name = self.names[n]
            lines.append(f"        {name} = {name}.clone()  # written in place below; keep the "
                         "received/batch tensor intact")
        return lines

    # -- lines ---------------------------------------------------------------------------
    def _line(self, node: fx.Node, indent: str = "        ") -> list[str]:
        """`name = op(args)  # module  placement  local shape`, wrapped when long."""
        note = annotation(node) + ("  recomputed here" if tf(node).get("recomputed") else "")
        comment = f"  # {note}" if note else ""
        head = f"{indent}{self.names[node]} = "
        if node.target is operator.getitem:
            return [head + self._call(node) + comment]
        callee, args = self._call_parts(node)
        return wrap_call(f"{head}{callee}(", args, comment, indent)

    # -- expressions ---------------------------------------------------------------------
    def _call(self, node: fx.Node) -> str:
        target = node.target
        if target is operator.getitem:
            return f"{self._arg(node.args[0])}[{self._arg(node.args[1])}]"
        callee, args = self._call_parts(node)
        return f"{callee}({', '.join(args)})"

    def _call_parts(self, node: fx.Node) -> tuple[str, list[str]]:
        args = [self._arg(a) for a in node.args]
        args += [f"{k}={self._arg(v)}" for k, v in node.kwargs.items()]
        return self._target(node.target), args

    def _target(self, target) -> str:
        if isinstance(target, torch._ops.OpOverload):
            ns = target.namespace
            if ns == "aten":
                return f"aten.{target._schema.name.split('::')[1]}.{target._overloadname}"
            return f"torch.ops.{ns}.{target._schema.name.split('::')[1]}.{target._overloadname}"
        kernel = getattr(target, "kernel_name", None)
        if kernel is not None:  # a fused region (passes/fusion.py)
            self.imports.add("from threefold.runtime.loader import sibling_module")
            self.imports.add('kernels = sibling_module(__file__, "kernels")')
            return f"kernels.{kernel}"
        module = getattr(target, "__module__", "") or ""
        if module.startswith("threefold.runtime."):
            alias = module.rsplit(".", 1)[-1]
            self.imports.add(f"import {module} as {alias}")
            return f"{alias}.{target.__name__}"
        raise NotImplementedError(f"codegen has no rule for call target {target!r}")

    def _arg(self, a) -> str:
        if isinstance(a, fx.Node):
            return self.names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self._arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if type(a).__name__ == "GroupRef":  # a process group, bound by the runtime
            return f"self.{a.name}_group"
        if type(a).__name__ == "TrainFlag":  # train/eval follows the module's mode
            return "self.training"
        if type(a).__name__ == "TrainValue":
            return f"({self._arg(a.value)} if self.training else {self._arg(a.eval_value)})"
        if type(a).__name__ == "RngRef":  # this op's own seed (runtime/random_ops.py)
            return f"self.rng_seed({a.index}, {a.per_tp_rank})"
        if isinstance(a, torch._ops.OpOverload):  # an op passed to random_ops.seeded
            return self._target(a)
        if isinstance(a, torch.device):
            self.uses_device = True
            return "dev"  # the module's own device, whatever device the model was traced on
        if isinstance(a, torch.dtype):
            return str(a)
        if isinstance(a, (torch.memory_format, torch.layout)):
            return str(a)
        if isinstance(a, float):
            if a != a:
                return 'float("nan")'
            if a in (float("inf"), float("-inf")):
                return 'float("inf")' if a > 0 else '-float("inf")'
            return repr(a)
        if isinstance(a, (int, bool, str)) or a is None:
            return repr(a)
        raise NotImplementedError(f"codegen cannot write the argument {a!r} ({type(a).__name__})")


_VIEW_OPS = fam.ALIASING | fam.ALIASING_PIECES   # a write through one is a write to its input


def _mutated_inputs(graph: fx.Graph, args: list[fx.Node]) -> list[fx.Node]:
    """Placeholders written in place, directly or through a view of them."""
    root: dict[fx.Node, fx.Node] = {a: a for a in args}
    hit: list[fx.Node] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        srcs = [a for a in node.all_input_nodes if a in root]
        schema = getattr(node.target, "_schema", None)
        name = schema.name.split("::")[-1] if schema is not None else ""
        if node.target is operator.getitem and srcs:
            root[node] = root[srcs[0]]
            continue
        if schema is None or not srcs:
            continue
        if schema.is_mutable:
            for i, a in enumerate(schema.arguments):
                value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                if a.alias_info is not None and a.alias_info.is_write and value in root:
                    if root[value] not in hit:
                        hit.append(root[value])
        if name in _VIEW_OPS and node.args and node.args[0] in root:
            root[node] = root[node.args[0]]
    return hit


def value_names(graph: fx.Graph, taken: set[str]) -> dict[fx.Node, str]:
    """Names for the graph's values from the model: a leaf module's only op takes the
    module's path (`h0_attn_c_attn`), other ops add the op's name (`h0_attn_c_proj_linear`,
    and its bias add `h0_attn_c_proj_add`); a getitem is its tuple's name and index."""
    calls = [n for n in graph.nodes if n.op == "call_function"]
    per_module = Counter(tf(n).get("module", "") for n in calls if n.target is not operator.getitem)
    parents = {m.rsplit(".", k)[0] for m in per_module for k in range(1, m.count(".") + 1)}
    used, names = set(taken), {}
    for n in calls:
        if n.target is operator.getitem and n.args[0] in names:
            base = f"{names[n.args[0]]}_{n.args[1]}"
        else:
            module = tf(n).get("module", "")
            path, op = _path_ident(module), _op_name(n.target)
            alone = path and per_module[module] == 1 and module not in parents   # a leaf's only op
            base = path if alone else "_".join(p for p in (path, op) if p)
        name, k = _ident(base), 1
        while name in used:
            name, k = f"{_ident(base)}_{k}", k + 1
        used.add(name)
        names[n] = name
    return names


def _path_ident(module: str) -> str:
    """`h.0.attn.c_attn` -> `h0_attn_c_attn` (layer indices stay with their container)."""
    parts = [p for p in (module or "").split(".") if p]
    out = parts[0] if parts else ""
    for p in parts[1:]:
        out += p if p.isdigit() else "_" + p
    return out


def _op_name(target) -> str:
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1].lstrip("_")
    return getattr(target, "kernel_name", None) or getattr(target, "__name__", "op")


def _ident(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "v"
    if (out[0].isdigit() or keyword.iskeyword(out)
            or out in ("self", "dev", "aten", "torch", "kernels", "lambda", "class")):
        out = "v_" + out
    return out
