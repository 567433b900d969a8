"""Attention masks under context parallelism: what ring attention needs to apply them exactly.

Each ring step meets a (query block, key block) pair that one process never cut out, so a
mask must be recomputable for any pair. An attention's mask operands (SDPA's attn_mask,
masked_fill(-inf) and added biases on the scores) are split into leaves over `+` (additive),
`&` (visible) and `|` (hidden), `~`, masked_fill(-inf) and where(cond, 0, -inf):

* a free leaf (constants, buffers, aranges; no input, no parameter) is evaluated at compile
  time over the whole sequence (its twin in the model traced at the whole length s: a trace
  of one rank's share holds sizes computed from the length as numbers, a window of t // 2 or
  HF's arange(batch) beside arange(t), which no reading of them can tell apart) and must
  depend on d = j - i only, as causal masks, sliding windows and ALiBi biases do:
  visible for lo <= d <= hi, bias slope[l] * d + intercept[l] per leading index l (a head).
  The fit is checked against the evaluated mask, so anything else (a document mask) is a
  PlanError, never a wrong mask. The ring computes the bias from global positions.
* a leaf from an input (a padding mask [B, S] as HF models take it, split along the
  sequence like every input) must be key-side, [..., 1, n]: cp_ops.key_bias turns such
  leaves into one additive bias that travels around the ring with its keys. A leaf that
  varies over queries, or depends on a parameter, is a PlanError.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.ir.program import tf
from threefold.errors import PlanError
from threefold.ops.families import COPIES, family, op_name
from threefold.runtime.tp_ops import GroupRef

_NEG = -1e30   # at or below: hidden (-inf, or finfo.min as HF writes it)


def free(node) -> bool:
    """Depends on no user input and no parameter (constants, buffers, aranges only)."""
    return _depends_on_none(node, ("buffer",))


def param_free(node) -> bool:
    """Depends on no parameter (a mask from inputs, buffers and constants; not scores)."""
    return _depends_on_none(node, ("buffer", "input"))


def input_free(node) -> bool:
    """Depends on no user input (parameters, buffers, constants only)."""
    return _depends_on_none(node, ("buffer", "param"))


def _depends_on_none(node, allowed: tuple) -> bool:
    seen, stack = set(), [node]
    while stack:
        x = stack.pop()
        if not isinstance(x, fx.Node) or x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder" and tf(x).get("kind") not in allowed:
            return False
        stack.extend(x.all_input_nodes)
    return True


def split_mask(masks: list, is_causal: bool, stage, node: fx.Node, n: int):
    """(causal, rel, keyside) for ring_attention: `causal` = the mask hides at least the
    future (the ring may skip those blocks), `rel` = the relative-position part
    (cp_ops.relative_bias) or None, `keyside` = [(kind, node)] leaves from inputs."""
    where = f"attention at {tf(node).get('module') or '<top>'}"
    leaves: list = []
    for kind, m in masks:
        _leaves(m, kind, leaves)
    fixed = [(k, m) for k, m in leaves if free(m)]
    keyside = [(k, m) for k, m in leaves if not free(m)]
    for _, m in keyside:
        val = m.meta.get("val")
        if not param_free(m):
            raise PlanError(f"cp: the mask of {where} depends on a parameter; ring attention takes masks "
                            "from positions and inputs only: use cp=1")
        if val is None or val.dim() < 2 or val.shape[-2] != 1 or val.shape[-1] != n:
            shape = None if val is None else tuple(val.shape)
            raise PlanError(f"cp: the mask of {where} comes from an input and is {shape}, not key-side "
                            f"[..., 1, {n}] (a padding mask over keys); ring attention cannot split it: use cp=1")
    if not fixed and not is_causal:
        return False, None, keyside
    if stage.is_meta:
        raise PlanError(f"cp: the mask of {where} cannot be checked on the meta device; compile with real "
                        "weights (threefold needs them to read the mask) or use cp=1")
    # the whole sequence's mask (a band of j - i reads the same at any length): at the real length
    # of a padded one (passes/cp_padding.py), where a buffer of exactly that many rows still fits
    s = n * stage.plan.cp - getattr(stage, "seq_tail", 0)
    whole = _additive(fixed, is_causal, stage, where, s)
    lead = whole.shape[:-2]
    lo, hi, slopes, intercepts = _fit(whole.reshape(-1, s, s), where)
    if len(set(slopes)) <= 1 and len(set(intercepts)) <= 1:   # the same for every batch row / head
        slopes, intercepts, lead = slopes[:1], intercepts[:1], ()
    heads = tuple(node.meta["val"].shape[:-2])   # the scores' leading dims (batch, heads)
    if len(lead) > len(heads) or _broadcast(tuple(lead), heads) != heads:
        raise PlanError(f"cp: the mask of {where} has leading dims {tuple(lead)} that do not broadcast to "
                        f"the attention's {heads}; use cp=1")
    causal = hi is not None and hi <= 0
    if lo is None and hi in (0, None) and not any(slopes) and not any(intercepts):
        return causal, None, keyside   # plain causal or all-visible: the ring's own masks
    return causal, (lo, hi, slopes, intercepts, tuple(lead)), keyside


def _leaves(m, kind: str, out: list) -> None:
    """Split a mask operand into leaves over the ops that combine masks (see module doc)."""
    if not isinstance(m, fx.Node) or free(m):
        out.append((kind, m))
        return
    name, args = op_name(m), m.args
    both = len(args) >= 2 and all(isinstance(a, fx.Node) for a in args[:2])
    if kind == "add" and name == "add" and both:
        _leaves(args[0], "add", out)
        _leaves(args[1], "add", out)
    elif kind == "visible" and name in ("bitwise_and", "logical_and", "__and__") and both:
        _leaves(args[0], "visible", out)
        _leaves(args[1], "visible", out)
    elif kind == "hidden" and name in ("bitwise_or", "logical_or", "__or__") and both:
        _leaves(args[0], "hidden", out)
        _leaves(args[1], "hidden", out)
    elif kind in ("visible", "hidden") and name in ("bitwise_not", "logical_not"):
        _leaves(args[0], "hidden" if kind == "visible" else "visible", out)
    elif kind == "add" and name == "masked_fill" and isinstance(args[2], (int, float)) and args[2] <= _NEG:
        _leaves(args[0], "add", out)
        _leaves(args[1], "hidden", out)
    elif kind == "add" and name == "where" and len(args) == 3 and _is_zero(args[1]) and \
            isinstance(args[2], (int, float)) and args[2] <= _NEG:
        _leaves(args[0], "visible", out)
    elif name in COPIES | {"expand"} and (
            kind == "add" or m.meta["val"].dtype == torch.bool == args[0].meta["val"].dtype):
        _leaves(args[0], kind, out)   # broadcasts and copies: the leaves broadcast the same way
    else:
        out.append((kind, m))


def _is_zero(x) -> bool:
    """0, or a free zero-dim node that is (HF writes torch.tensor(0.0) into where)."""
    if isinstance(x, (int, float)):
        return x == 0
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return val is not None and val.dim() == 0 and op_name(x) in ("zeros", "zeros_like") and free(x)


def _additive(fixed: list, is_causal: bool, stage, where: str, length: int) -> torch.Tensor:
    """The free leaves' sum over the whole sequence (`length` positions) as an additive float64
    mask (-inf hidden), read from their twins in the model traced at that length (`_twin`): a
    trace of one rank's share holds sizes computed from the length (a window of t // 2, HF's
    arange(batch) beside arange(t)) as plain numbers, which no reading of them can tell apart."""
    total = torch.zeros(length, length, dtype=torch.float64)
    if is_causal:
        total = total.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool)), float("-inf"))
    for kind, m in fixed:
        try:
            if not isinstance(m, fx.Node):
                v = torch.tensor(m)
            else:
                _whole_on_every_tp_rank(m)
                v = evaluate(_twin(m, stage, length, where), stage)
        except PlanError:
            raise
        except _PerRank as exc:
            raise PlanError(f"cp: the mask of {where} is split over tp ranks ({exc}: a per-head bias with "
                            "heads sharded); use tp=1 or cp=1") from None
        except Exception as exc:
            raise PlanError(f"cp: the mask of {where} cannot be evaluated over the whole sequence "
                            f"({type(exc).__name__}: {str(exc)[:120]}); use cp=1") from None
        v = torch.as_tensor(v)
        if kind == "add":
            v = v.to(torch.float64).masked_fill(v <= _NEG, float("-inf"))
        else:
            hide = ~v.bool() if kind == "visible" else v.bool()
            v = torch.zeros(hide.shape, dtype=torch.float64).masked_fill(hide, float("-inf"))
        if v.dim() < 2 or v.shape[-2] not in (1, length) or v.shape[-1] != length:
            raise PlanError(f"cp: the mask of {where} is {tuple(v.shape)}, not over the sequence "
                            f"({length} x {length}); use cp=1")
        while v.dim() > 2 and bool((v == v[:1]).all()):   # the same for every batch row: broadcast it
            v = v[0]                                        # (HF's [b, 1, s, s] beside Bloom's [b*h, 1, s])
        total = total + v
    return total


def _twin(m: fx.Node, stage, length: int, where: str) -> fx.Node:
    """m's node in the model traced at `length` positions (stage.retrace): the node of m's name
    computed by the same ops from the same leaves, else a PlanError (the graph changed with the
    length: no twin can be trusted)."""
    if getattr(stage, "retrace", None) is None:
        raise PlanError(f"cp: the mask of {where} needs the model traced at the whole sequence's length, "
                        "which this compile cannot do; use cp=1")
    try:
        graph = stage.retrace(length)
    except PlanError as exc:
        raise PlanError(f"cp: the mask of {where} needs the model traced at the whole sequence's length "
                        f"{length}, which failed ({str(exc)[:120]}); use cp=1") from None
    twin = next((x for x in graph.nodes if x.name == m.name), None)
    if twin is None or _recipe(twin) != _recipe(m):
        raise PlanError(f"cp: the mask of {where} is built by other ops at the whole sequence's length "
                        f"{length} than at this rank's (control flow on the length?); use cp=1")
    return twin


def _whole_on_every_tp_rank(m: fx.Node) -> None:
    """The twin is read from the model before tp: a mask tp slices per rank (a per-head bias with
    heads sharded) would be read whole, so it is refused here."""
    for x in _recipe_nodes(m):
        if any(isinstance(a, GroupRef) for a in list(x.args) + list(x.kwargs.values())):
            raise _PerRank(op_name(x))


def _recipe_nodes(node: fx.Node) -> list:
    seen, stack, out = set(), [node], []
    while stack:
        x = stack.pop()
        if isinstance(x, fx.Node) and x not in seen:
            seen.add(x)
            out.append(x)
            stack.extend(x.all_input_nodes)
    return out


def _recipe(node: fx.Node) -> list:
    """The leaves node reads and the ops that compute it from them, layout ops aside (a table
    sliced to the length, `mask[:t, :t]`, is no slice at all at the table's own length)."""
    layout = ("copy", "view", "slicing", "dim_move")
    leaves = ("placeholder", "get_attr")   # chunk graphs may rename leaves: their fqn says which
    return sorted(("leaf", str(tf(x).get("fqn"))) if x.op in leaves else (x.op, str(x.target))
                  for x in _recipe_nodes(node) if x.op in leaves or family(x) not in layout)


def _broadcast(a: tuple, b: tuple):
    try:
        return torch.broadcast_shapes(a, b)
    except RuntimeError:
        return None


def _fit(m: torch.Tensor, where: str):
    """m [L, s, s] (additive, -inf hidden) as a function of d = j - i: (lo, hi, slopes,
    intercepts), lo/hi None where unbounded; a PlanError if it is not one."""
    L, s, _ = m.shape
    d = torch.arange(s)[None, :] - torch.arange(s)[:, None]
    visible = ~torch.isinf(m)
    if not bool((visible == visible[:1]).all()):
        raise PlanError(f"cp: the mask of {where} hides different positions per head; use cp=1")
    vis = visible[0]
    if not bool(vis.any()):
        raise PlanError(f"cp: the mask of {where} hides every position; use cp=1")
    lo, hi = int(d[vis].min()), int(d[vis].max())
    if not torch.equal(vis, (d >= lo) & (d <= hi)):
        raise PlanError(f"cp: the mask of {where} is not a band of relative positions (a document, prefix "
                        "or block mask?); ring attention takes causal, sliding-window and ALiBi masks: use cp=1")
    x = d[vis].to(torch.float64)
    design = torch.stack([x, torch.ones_like(x)], 1)
    slopes, intercepts = [], []
    for row in m:
        y = row[vis]
        coef = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
        if not bool(torch.allclose(design @ coef, y, rtol=1e-6, atol=1e-6 * (1 + float(y.abs().max())))):
            coef = _fit_per_query(row, d, vis, where)
        slope, icpt = (_snap(float(c)) for c in coef)
        slopes.append(slope if abs(slope) > 1e-12 else 0.0)
        intercepts.append(icpt if abs(icpt) > 1e-12 else 0.0)
    return (None if lo == -(s - 1) else lo), (None if hi == s - 1 else hi), slopes, intercepts


def _fit_per_query(row: torch.Tensor, d: torch.Tensor, vis: torch.Tensor, where: str) -> torch.Tensor:
    """(slope, 0) for a bias slope * (j - i) + r_i, r_i any number per query (Bloom's ALiBi is
    slope * j): the softmax over each query's keys does not see r_i, so slope * (j - i) is the
    same attention. A PlanError if the row is not of that form."""
    y = torch.where(vis, row.to(torch.float64), torch.zeros((), dtype=torch.float64))
    x = torch.where(vis, d.to(torch.float64), torch.zeros((), dtype=torch.float64))
    count = vis.sum(-1, keepdim=True).clamp(min=1)
    yc = torch.where(vis, y - y.sum(-1, keepdim=True) / count, torch.zeros((), dtype=torch.float64))[vis]
    xc = torch.where(vis, x - x.sum(-1, keepdim=True) / count, torch.zeros((), dtype=torch.float64))[vis]
    slope = float((xc * yc).sum() / (xc * xc).sum()) if bool((xc != 0).any()) else 0.0
    if not bool(torch.allclose(slope * xc, yc, rtol=1e-6, atol=1e-6 * (1 + float(y.abs().max())))):
        raise PlanError(f"cp: the additive mask of {where} is not slope * (j - i) + c per head (not an "
                        "ALiBi-style bias); ring attention cannot recompute it: use cp=1")
    return torch.tensor([slope, 0.0], dtype=torch.float64)


class _PerRank(Exception):
    """The mask runs a collective op (tp): one value cannot stand for every rank."""


def _snap(x: float) -> float:
    """x as the float32 it is within least-squares rounding of (the mask's own dtype, usually)."""
    f = float(torch.tensor(x, dtype=torch.float32))
    return f if abs(f - x) <= 1e-12 * max(abs(x), 1.0) else x


def key_bias_val(keyside: list) -> torch.Tensor:
    """The fake value of cp_ops.key_bias over these leaves (for the node's meta)."""
    shape = torch.broadcast_shapes(*[m.meta["val"].shape for _, m in keyside])
    dtypes = [m.meta["val"].dtype for k, m in keyside if k == "add"]
    dtype = dtypes[0] if dtypes else torch.float32
    for dt in dtypes[1:]:
        dtype = torch.promote_types(dtype, dt)
    like = keyside[0][1].meta["val"]
    return like.new_empty(shape, dtype=dtype if dtype.is_floating_point else torch.float32)


def evaluate(node: fx.Node, stage):
    """The value of a free node, computed from the stage's buffers and constants."""
    env: dict = {}

    def value(x):
        if isinstance(x, fx.Node):
            if x not in env:
                env[x] = run(x)
            return env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(value(a) for a in x)
        return x

    def run(x: fx.Node):
        if x.op == "placeholder":
            return stage.state[tf(x)["fqn"]]
        if x.op == "get_attr":
            return getattr(x.graph.owning_module, x.target)
        args = [value(a) for a in x.args]
        kwargs = {k: value(v) for k, v in x.kwargs.items()}
        return x.target(*args, **kwargs)
    with torch.no_grad():
        return value(node)
