"""A loss torch.export cannot trace, computed eagerly on the last stage's outputs.

CTC (aten._ctc_loss: its output shape depends on the data) and any loss that calls
.item() or Python control flow on values make the whole model untraceable, though only the
loss is the problem. Then (or when the plan says `loss=eager`) we trace the model alone and
end its graph with one call, `runtime.eager_loss.call_loss(key, tree, scale, target,
*outputs)`: the user's loss_fn in Python, differentiated by autograd as it runs.

The graph cannot show how such a loss combines rows, so `loss_reduction` measures it on the
example batch: the model runs once (no grad, random state and buffers restored), and the
loss of the whole batch is compared with the losses of its rows. Equal to their mean: a mean
over rows, combined over microbatches and dp ranks exactly as a traced mean is (numerator =
loss * rows, denominator = rows; passes/loss_form.py); equal to their sum: a sum. Anything
else (a masked mean whose count varies by row, a nonlinear loss) cannot be split exactly, and
loss_form refuses m*dp > 1 naming the loss, as for a traced loss.
"""
from __future__ import annotations

import json

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from threefold.ir.program import TensorMeta, is_eager_loss, tf
from threefold.ir.stages import Traced
from threefold.errors import PlanError
from threefold.runtime.eager_loss import call_loss, key_of


def add_eager_loss(prog: Traced, wrapper, name: str, n_inputs: int, target, loss_fn, why: str) -> Traced:
    """The model traced alone (`prog`, by compiler/trace.py with `wrapper`), its graph ended
    by an eager call of `loss_fn`."""
    gm, graph = prog.gm, prog.gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    if not all(isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) for o in outs):
        raise PlanError(f"{name}: the loss is computed eagerly ({why}), but the model returns values "
                        "that are not tensors; return tensors only")
    fake = outs[0].meta["val"]
    mode = getattr(fake, "fake_mode", None)
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_ph):
        tph = graph.placeholder("target")
    tph.meta["val"] = mode.from_tensor(target) if mode is not None else target.to("meta")
    tf(tph).update(kind="input", input_index=n_inputs)
    key = key_of(loss_fn)
    floats = [o.meta["val"].dtype for o in outs if o.meta["val"].is_floating_point()]
    dtype = floats[0] if floats else torch.float32
    with graph.inserting_before(out_node):
        loss = graph.call_function(call_loss, (key, json.dumps(wrapper.output_tree()), 1.0, tph, *outs))
    if mode is not None:
        with mode:
            loss.meta["val"] = torch.empty((), dtype=dtype)
    else:
        loss.meta["val"] = torch.empty((), dtype=dtype, device="meta")
    tf(loss).update(module="", eager_loss=key)
    out_node.args = ((loss,),)
    gm.recompile()
    note = f"loss {key} runs eagerly on the last stage ({why})"
    return prog.evolve(has_loss=True, input_names=prog.input_names + ("target",),
                       output_meta=(TensorMeta.of(loss.meta["val"]),),
                       model_outputs=tuple(o.name for o in outs),
                       model_output_meta=tuple(TensorMeta.of(o.meta["val"]) for o in outs),
                       output_tree=wrapper.output_tree(), notes=prog.notes + (note,))


def eager_node(prog) -> fx.Node | None:
    out = next(n for n in prog.gm.graph.nodes if n.op == "output")
    node = out.args[0][0] if out.args and out.args[0] else None
    return node if is_eager_loss(node) else None


def loss_reduction(model, batch: tuple, dims: list, loss_fn) -> str | None:
    """'mean' or 'sum' when the loss of the whole example batch is the mean or sum of its
    rows' losses; None when neither (or when it cannot be measured: meta weights)."""
    *inputs, target = batch
    tdim = dims[-1]
    if tdim is None or any(p.is_meta for p in model.parameters()) or target.shape[tdim] < 2:
        return None
    rows = target.shape[tdim]
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(*inputs)
            whole = float(loss_fn(out, target))
            leaves, spec = pytree.tree_flatten(out)
            odims = [_row_dim(t, rows, tdim) if isinstance(t, torch.Tensor) else None for t in leaves]
            if any(isinstance(t, torch.Tensor) and d is None for t, d in zip(leaves, odims)):
                return None
            per_row = []
            for i in range(rows):
                part = [t.narrow(d, i, 1) if isinstance(t, torch.Tensor) else t for t, d in zip(leaves, odims)]
                per_row.append(float(loss_fn(pytree.tree_unflatten(part, spec), target.narrow(tdim, i, 1))))
    except Exception:   # the loss refuses single rows: cannot measure
        return None
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    scale = max(abs(whole), 1e-12)
    if abs(sum(per_row) / rows - whole) <= 1e-5 * scale:
        return "mean"
    if abs(sum(per_row) - whole) <= 1e-5 * scale:
        return "sum"
    return None


def _row_dim(t: torch.Tensor, rows: int, prefer: int) -> int | None:
    hits = [d for d in range(t.dim()) if t.shape[d] == rows]
    if prefer in hits:
        return prefer
    return hits[0] if hits else None
