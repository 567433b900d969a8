"""What cp decides for an op that reads a value computed whole on every rank (passes/cp_whole.py):
rerun it on whole values alone, else the all-gather fallback around it (cp's redistribution on
the sharding walker, passes/shard.py)."""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.errors import PlanError
from threefold.ops.families import args_of, is_pointwise, op_name
from threefold.passes.cp_factories import local_factories
from threefold.passes.cp_masks import input_free
from threefold.passes.cp_fallback import gather_around
from threefold.passes.cp_rules import Gather, Refuse, Seq
from threefold.passes.cp_tables import position_slices
from threefold.passes.cp_whole import is_whole, run_whole, whole_length


class GatherWhole(Gather):
    """Gather for an op that reads a whole value: its redistribution (`whole_inputs`) reruns it
    on whole values alone where it can."""


def whole_decision(node: fx.Node, state: dict, stage, why: str):
    """The decision for an op that reads a whole value (`why`: its refusal message): a mask made
    of ones(b, n) beside the whole scores is split first (a Refuse naming it), and so is an
    input-free table sliced to the sequence (a decay grid D[:n, :n] beside the whole scores:
    it then reads this rank's rows, and free_inputs_whole rebuilds it whole), else GatherWhole."""
    n = stage.seq_len
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if state.get(a) is None and not is_whole(a) and position_slices(a, stage):
            return Refuse(f"{why} (it meets a table sliced to the sequence)", a)
        if state.get(a) is None and not is_whole(a) and isinstance(v, torch.Tensor) and n in v.shape \
                and local_factories(a, state, n, stage):
            return Refuse(f"{why} (it meets a value of the local length made in forward)", a)
    return GatherWhole("mixes sequence positions")


def whole_inputs(node: fx.Node, state: dict, stage, why: str):
    """Run an op that reads a whole value on whole values alone, else the all-gather fallback
    around it (its split inputs gathered, its output cut back where one dim runs along the
    sequence): (its state, bytes moved per gathered input)."""
    _widen_broadcasts(node, state, stage, Seq)
    if not any(isinstance(state.get(a), Seq) for a in node.all_input_nodes):
        if any(state.get(a) is not None for a in node.all_input_nodes):
            raise PlanError(f"{why} (it meets a value that is neither split nor whole)")
        try:
            run_whole(node, stage.seq_len, why, stage)
        except PlanError as exc:
            raise PlanError(_local_sized(node, state, stage) or str(exc)) from None
        return None, []
    return gather_around(node, state, stage, why, op_name(node), Seq)


def _local_sized(node: fx.Node, state: dict, stage):
    """Why an op on a whole grid fails where it meets an input-free value of the local length
    that is no table sliced to the sequence (a decay table of one block, the block as long as a
    rank's share: the model's loop over blocks differs at the whole length), else None."""
    n, cp = stage.seq_len, stage.plan.cp
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if state.get(a) is None and not is_whole(a) and isinstance(v, torch.Tensor) and n in v.shape \
                and input_free(a):
            return (f"cp={cp}: {op_name(node)} at {a.meta.get('tf', {}).get('module') or '<top>'} reads "
                    f"{a.name} {tuple(v.shape)}, made of parameters and buffers, with {n} positions (this rank's "
                    f"share) beside the whole sequence ({whole_length(stage)}): the model sizes it from the length it runs on "
                    f"(a block of a blockwise loop as long as the share?), which differs on one process; use a "
                    f"sequence of at least {2 * cp} such blocks (a multiple of 2*cp blocks) or cp=1")
    return None


def _widen_broadcasts(node: fx.Node, state: dict, stage, seq_cls) -> None:
    """A split input of `node` that is a broadcast of size 1 along another dim of the local
    length, where a whole input has the whole length (T5's all-visible mask [b, 1, q, k],
    expanded over its keys, beside the whole relative-position bias): read it at one key and
    broadcast it to the whole length there. Exact, since it is uniform along that dim."""
    n, whole_len = stage.seq_len, whole_length(stage)
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return
    wides = [a.meta["val"] for a in node.all_input_nodes if is_whole(a) and isinstance(a.meta.get("val"), torch.Tensor)]
    for a in list(node.all_input_nodes):
        s, v = state.get(a), a.meta.get("val")
        if not isinstance(s, seq_cls) or not isinstance(v, torch.Tensor):
            continue
        r = v.dim()
        dims = [e for e in uniform_dims(a) if e != s.dim and v.shape[e] == n
                and any(w.dim() >= r - e and w.shape[w.dim() - (r - e)] == whole_len for w in wides)]
        if not dims:
            continue
        shape = [whole_len if e in dims else v.shape[e] for e in range(r)]
        graph = node.graph
        with graph.inserting_before(node):
            one = a
            for e in dims:
                one = graph.call_function(torch.ops.aten.narrow.default, (one, e, 0, 1))
                one.meta = {"val": (one.args[0].meta["val"]).narrow(e, 0, 1), "tf": dict(a.meta.get("tf", {}))}
                state[one] = s
            wide = graph.call_function(torch.ops.aten.expand.default, (one, shape))
        wide.meta = {"val": one.meta["val"].expand(shape), "tf": dict(a.meta.get("tf", {}))}
        state[wide] = s
        node.args = fx.node.map_arg(node.args, lambda x: wide if x is a else x)
        node.kwargs = fx.node.map_arg(node.kwargs, lambda x: wide if x is a else x)


def uniform_dims(x, depth: int = 8) -> set:
    """Dims along which x's value is the same everywhere (by construction: broadcasts of size 1
    through expand and element-wise ops), as dims of x."""
    if not isinstance(x, fx.Node) or depth == 0 or not isinstance(x.meta.get("val"), torch.Tensor):
        return set()
    v = x.meta["val"]
    name = op_name(x)
    if name == "expand":
        src = args_of(x)["self"]
        sv = src.meta.get("val")
        lead = v.dim() - sv.dim()
        ones = {e for e in range(v.dim()) if e < lead or sv.shape[e - lead] == 1}
        return ones | {e + lead for e in uniform_dims(src, depth - 1)}
    if is_pointwise(x):
        dims = set(range(v.dim()))
        for a in x.all_input_nodes:
            av = a.meta.get("val")
            if not isinstance(av, torch.Tensor):
                continue
            lead = v.dim() - av.dim()
            dims &= {e for e in range(v.dim()) if e < lead or av.shape[e - lead] == 1} | \
                {e + lead for e in uniform_dims(a, depth - 1)}
        return dims
    return set()
