"""cp (plan `cp=N`) for a sequence made inside the model (a ViT's patch tokens from pixels).

No input dim is the sequence there: the images [B, 3, H, W] are not cut. The sequence is born
inside forward (conv patch embedding, flatten, transpose, a CLS token concatenated), and cp
starts at that point instead:

1. `find_birth`: in the model traced whole (cp=1), the first attention's query length L is
   followed back along the data path (values computed from the inputs with a dim of size L)
   to the value where that dim first appears: a node none of whose input-derived arguments
   has a dim of size L. Its torch-level call (node.meta["torch_fn"], the k-th call of that
   torch function) is what the second trace cuts.
2. `calls_of`: the model is traced again with a TorchFunctionMode that passes that call's output
   through `threefold::cp_cut` (this rank's blocks r, 2cp-1-r along the born dim; its fake
   returns the local length), so every view and reshape after it is traced at L/cp. After the
   cut, an element-wise operand holding all L positions where another holds this rank's (a
   position table added whole, or interpolated to the image in forward) is cut too: exact,
   since broadcasting pairs the same positions. A per-token target along the born sequence
   [B, L] is cut like an input sequence (`along_birth`).
3. `to_shard_seq`: the cut becomes runtime/cp_gather.shard_seq (forward: this rank's blocks;
   backward: their rows in a zero gradient), which the cp rules place as Seq(dim); everything
   before it (the prefix) runs whole on every cp rank, redundant but exact. The prefix's
   parameter gradients are then partial sums over this rank's positions, summed once over the
   cp group with every other replicated parameter's gradient.

A born length that 2*cp does not divide is padded at the cut (cp_cut's fake and the runtime's
shard_seq both pad through cp_ops.pad_to_blocks), its last positions standing for nothing; the
stage's `seq_tail` tells passes/cp_padding.py, which keeps them out of what mixes positions.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from threefold.errors import PlanError
from threefold.ir.program import tf, upstream
from threefold.ops.families import ELEMENTWISE_BINARY, args_of, op_name
from threefold.passes.cost import node_cost
from threefold.runtime import cp_gather
from threefold.runtime.cp_ops import block_positions, local_blocks, seq_tail
from threefold.runtime.tp_ops import GroupRef

CP = GroupRef("cp")


@torch.library.custom_op("threefold::cp_cut", mutates_args=())
def cp_cut(x: torch.Tensor, dim: int, ranks: int) -> torch.Tensor:
    """The first cp rank's blocks of x along dim (what the trace sees; the runtime runs shard_seq)."""
    return local_blocks(x, dim, ranks, 0).clone()


@cp_cut.register_fake
def _cp_cut_fake(x, dim, ranks):
    shape = list(x.shape)   # a length 2*cp does not divide is padded first (cp_ops.pad_to_blocks)
    shape[dim] = (shape[dim] + seq_tail(shape[dim], ranks)) // ranks
    return x.new_empty(shape)


def _cut_backward(ctx, g):
    n = g.shape[ctx.dim]
    shape = list(ctx.shape)
    shape[ctx.dim] = n * ctx.ranks   # the padded length; the padding's gradient is dropped
    full = g.new_zeros(shape).index_copy(ctx.dim, block_positions(n, ctx.ranks, 0, device=g.device), g)
    return full.narrow(ctx.dim, 0, ctx.shape[ctx.dim]), None, None


def _cut_context(ctx, inputs, output):
    x, dim, ranks = inputs
    ctx.shape, ctx.dim, ctx.ranks = x.shape, dim, ranks


cp_cut.register_autograd(_cut_backward, setup_context=_cut_context)


@dataclass(frozen=True)
class Birth:
    """Where the sequence is born: the node (its name and module), the torch-level call that
    makes it (`call`: (qualified function name, k) for its k-th call; None where export left
    no torch_fn), its dims of that length (`dims`: where several, each is tried) and the length."""
    node: str
    module: str
    call: tuple | None
    dims: tuple
    length: int
    prefix: tuple   # the ops before the cut that read the inputs (run whole on every cp rank)
    prefix_flops: int = 0   # their forward FLOPs per microbatch (passes/cost.py), and the whole model's
    total_flops: int = 0
    sources: tuple = ()     # the batch entries (input indices) the born value is computed from

    def note(self, cp: int, dim: int) -> str:
        ops = ", ".join(self.prefix) or "none"
        share = f", {100 * self.prefix_flops / self.total_flops:.1f}%" if self.total_flops else ""
        tail = seq_tail(self.length, cp)
        pad = f"; padded by {tail} position(s) that stand for nothing, passes/cp_padding.py" if tail else ""
        return (f"cp: the sequence ({self.length} positions) is born inside the model at `{self.node}` "
                f"({self.module}, dim {dim}); cp starts there: each rank cuts its {-(-self.length // (2 * cp)) * 2} "
                f"positions (blocks r, 2cp-1-r{pad}) and the ops before it run whole on every cp rank, redundantly "
                f"({ops}: {self.prefix_flops} of the model's {self.total_flops} forward FLOPs per "
                f"microbatch{share})")


def find_birth(graph: fx.Graph) -> Birth | None:
    """The first attention's query length, followed back to where it is born (module doc, 1);
    None where the model has no attention or the length comes with an input."""
    attn = _first_attention(graph)
    if attn is None:
        return None
    query, length = attn
    derived = _input_derived(graph)
    seen, stack, births = set(), [query], []
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        ups = [a for a in x.all_input_nodes if a in derived and _has_length(a, length)]
        if not ups:
            births.append(x)
        stack.extend(ups)
    order = {n: i for i, n in enumerate(graph.nodes)}
    if not births or any(b.op == "placeholder" for b in births):
        return None   # an input carries the sequence: the seq_dims path decides
    born = _call_output(min(births, key=order.get), graph)
    fn = born.meta.get("torch_fn")
    call = (fn[1], int(fn[0].rsplit("_", 1)[1])) if fn is not None else None
    before = sorted(upstream(born) & derived, key=order.get)   # the prefix: what the born value is made of
    ops = [n for n in before if n.op == "call_function"]
    sources = tuple(sorted(tf(n)["input_index"] for n in before if n.op == "placeholder"))
    return Birth(born.name, tf(born).get("module") or "<top>", call, tuple(_dims_of(born, length)), length,
                 tuple(dict.fromkeys(op_name(n) for n in ops)), sum(node_cost(n).flops for n in ops),
                 sum(node_cost(n).flops for n in graph.nodes if n.op == "call_function"), sources)


def along_birth(batch: tuple, rows: list, birth: Birth) -> list:
    """Per batch entry, the dim to cut to this rank's blocks: the one non-batch dim of the born
    length in an entry the sequence is not made from (a per-token target [B, L]), else None."""
    out = []
    for i, t in enumerate(batch):
        row = 0 if i >= len(rows) or rows[i] is None else rows[i]
        dims = [d for d in range(t.dim()) if d != row and t.shape[d] == birth.length] \
            if isinstance(t, torch.Tensor) and i not in birth.sources else []
        out.append(dims[0] if len(dims) == 1 else None)
    return out


class _Calls(TorchFunctionMode):
    """Counts each torch function's calls, as torch.export's torch_fn metadata does (its k-th
    call); records their output shapes (`shapes`) and, at `cut` = (name, k), passes the
    output through cp_cut. After the cut, an element-wise operand that holds all `length`
    positions where another holds this rank's (a position table interpolated in forward,
    added whole) is cut too (`also`): exact, since broadcasting pairs the same positions."""

    def __init__(self, cut: tuple | None = None, dim: int = 0, ranks: int = 1, length: int = 0):
        super().__init__()
        self.counts, self.shapes, self.cut, self.dim, self.ranks, self.done = {}, {}, cut, dim, ranks, False
        self.length, self.also = length, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        name = getattr(func, "__name__", "")
        key = (f"{type(func).__name__}.{name}", self.counts[func])
        if self.done and _elementwise(name) and self.ranks > 1:
            args = self._cut_whole(args)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.shapes.setdefault(key, tuple(out.shape))
        if key == self.cut and isinstance(out, torch.Tensor) and not self.done:
            self.done = True
            return torch.ops.threefold.cp_cut(out, self.dim, self.ranks)
        return out

    def _cut_whole(self, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) < 2:
            return args
        rank, n = max(t.dim() for t in tensors), (self.length + seq_tail(self.length, self.ranks)) // self.ranks

        def size(t, e):   # t's size at dim e of the broadcast shape (1 where t has no such dim)
            return t.shape[e - rank + t.dim()] if e >= rank - t.dim() else 1
        out = list(args)
        for e in range(rank):
            if {n, self.length} <= {size(t, e) for t in tensors}:
                for i, a in enumerate(out):
                    if isinstance(a, torch.Tensor) and size(a, e) == self.length:
                        out[i] = torch.ops.threefold.cp_cut(a, e - rank + a.dim(), self.ranks)
                        self.also += 1
        return tuple(out)


@contextmanager
def calls_of(model: torch.nn.Module, cut: tuple | None = None, dim: int = 0, ranks: int = 1, length: int = 0):
    """While `model` runs forward (inside a trace): its torch-level calls counted (and cut).
    The mode is entered inside forward, above export's own modes, so it sees the calls export's
    torch_fn metadata counts, in the same order."""
    mode = _Calls(cut, dim, ranks, length)
    forward, own = model.forward, model.__dict__.get("forward")

    def counted(*args, **kwargs):   # counted afresh on each forward (a trace may export twice)
        mode.counts, mode.done, mode.also = {}, False, 0
        with mode:   # (a `with`, so an export that fails pops its modes in order)
            return forward(*args, **kwargs)
    model.forward = counted
    try:
        yield mode
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def to_shard_seq(gm: fx.GraphModule, cp: int) -> int:
    """threefold::cp_cut -> cp_gather.shard_seq (this rank's blocks at run time); their count."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.threefold.cp_cut.default:
            a = args_of(node)
            with gm.graph.inserting_before(node):
                cut = gm.graph.call_function(cp_gather.shard_seq, (a["x"], a["dim"], CP), {"ranks": cp})
            cut.meta = dict(node.meta)
            node.replace_all_uses_with(cut)
            gm.graph.erase_node(node)
            count += 1
    gm.recompile()
    return count


def _elementwise(name: str) -> bool:
    """A torch-level element-wise call whose operands broadcast: add, Tensor.add, `__add__`,
    reflected `__radd__`, `__truediv__` (in place, `add_` / `__iadd__`, is not: cutting its
    `self` would write a copy)."""
    if name.endswith("_") and not name.startswith("__"):
        return False
    base = name.strip("_")
    base = "div" if base in ("truediv", "rtruediv") else base
    return base in ELEMENTWISE_BINARY or (name.startswith("__r") and base[1:] in ELEMENTWISE_BINARY)


def _first_attention(graph: fx.Graph):
    """(query node, its length) at the first attention (SDPA, or softmax over matmul scores)."""
    for node in graph.nodes:
        name = op_name(node) if node.op == "call_function" else None
        if name == "scaled_dot_product_attention":
            q = args_of(node)["query"]
        elif name in ("softmax", "_softmax") and op_name(node.args[0]) in ("matmul", "bmm", "mul", "div", "add"):
            q = node
        else:
            continue
        v = q.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            return q, v.shape[-2]
    return None


def _input_derived(graph: fx.Graph) -> set:
    """Nodes computed from a user input (not from parameters, buffers and constants alone)."""
    out = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and tf(n).get("kind") == "input") or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _has_length(node: fx.Node, length: int) -> bool:
    """A dim of size `length` in node's value (in any of its tensors, for an op with several outputs)."""
    v = node.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    return any(isinstance(t, torch.Tensor) and length in t.shape for t in vals)


def _dims_of(node: fx.Node, length: int) -> list:
    v = node.meta.get("val")
    return [d for d, s in enumerate(v.shape) if s == length] if isinstance(v, torch.Tensor) else []


def _call_output(node: fx.Node, graph: fx.Graph) -> fx.Node:
    """The last node of node's torch-level call (the value the model's Python code holds)."""
    fn = node.meta.get("torch_fn")
    same = [n for n in graph.nodes if fn is not None and n.meta.get("torch_fn") == fn]
    return same[-1] if same else node
