"""What the fusion pass may fuse: the per-node tests and the pattern matchers.

`fusible(node)` says whether one ATen node can become part of a fused kernel; the matchers
recognise multi-node forms the pass turns into one row region: the decomposed RMSNorm
(x * rsqrt(mean(x^2) + eps) * w), rotary embeddings (x * cos + cat(-x2, x1) * sin), and a
causal mask built in the graph (tril/triu of ones), which the kernel recomputes from
indices instead of loading.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.passes.fusion_regions import ELEMENTWISE, FLOAT_DTYPES, POW_EXPONENTS
from threefold.runtime.kernels import pattern_of

CASTS = ("aten._to_copy.default", "aten.to.dtype")
VIEWISH = ("aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
           "aten.expand.default", "aten.alias.default", "aten.detach.default")


def val_of(node):
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def fusible(node) -> bool:
    """An elementwise ATen op over float/bool tensors that a fused kernel can compute."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    t = str(node.target)
    v = val_of(node)
    if t not in ELEMENTWISE or v is None or v.dim() == 0:
        return False
    short = ELEMENTWISE[t]
    if v.dtype not in FLOAT_DTYPES and not (short == "not" and v.dtype == torch.bool):
        return False
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, fx.Node):
            av = val_of(a)
            if av is None or (av.dtype not in FLOAT_DTYPES and av.dtype != torch.bool):
                return False
            if pattern_of(av.shape, v.shape) == "invalid":
                return False
        elif not isinstance(a, (int, float, bool, str, torch.dtype, type(None), torch.memory_format)):
            return False
    if short == "div" and node.kwargs.get("rounding_mode") is not None:
        return False
    if short == "pow" and node.args[1] not in POW_EXPONENTS:
        return False
    if short == "dropout" and not (0 <= float(node.args[1]) < 1):
        return False
    if t == "aten._to_copy.default" and (set(node.kwargs) - {"dtype"} or len(node.args) > 1):
        return False
    if short == "cast" and v.dtype == torch.bool:
        return False
    return True


def half_to_float(node) -> bool:
    return str(node.target) == "aten._softmax.default" and len(node.args) > 2 and node.args[2] is True


def mask_pos(node):
    """Which argument of a masked_fill / where is the bool mask (None for other ops)."""
    short = ELEMENTWISE.get(str(node.target)) if isinstance(node, fx.Node) else None
    return {"masked_fill": 1, "where": 0}.get(short)


def last_dim(node, dim) -> bool:
    nd = val_of(node).dim()
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % max(nd, 1) == nd - 1


ASSERT_META = "aten._assert_tensor_metadata.default"


def users(node) -> list:
    """Users that compute something: export's dtype asserts on intermediates do not count."""
    return [u for u in node.users if not (u.op == "call_function" and str(u.target) == ASSERT_META)]


def sole_user(node):
    found = users(node) if isinstance(node, fx.Node) else []
    return found[0] if len(found) == 1 else None


def is_op(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and str(node.target) in targets


def causal_form(node):
    """If `node` is a bool tril/triu(ones) mask (sliced from the top left, maybe negated or
    given leading dims), return (form, diagonal, negate, chain nodes); else None."""
    v = val_of(node)
    if v is None or v.dtype != torch.bool or v.dim() < 2:
        return None
    chain, negate, n = [], False, node
    while isinstance(n, fx.Node) and n.op == "call_function":
        t = str(n.target)
        src = n.args[0] if n.args else None
        sv = val_of(src)
        if t in ("aten.bitwise_not.default", "aten.logical_not.default"):
            negate = not negate
        elif t == "aten.slice.Tensor":
            dim = n.args[1] if len(n.args) > 1 else 0
            start = n.args[2] if len(n.args) > 2 else None
            step = n.args[4] if len(n.args) > 4 else 1
            if sv is None or dim % sv.dim() < sv.dim() - 2 or start not in (None, 0) or step != 1:
                return None
        elif t in VIEWISH:
            if sv is None or sv.dim() < 2 or tuple(sv.shape[-2:]) != tuple(val_of(n).shape[-2:]):
                return None
        elif t in ("aten.tril.default", "aten.triu.default"):
            ok = is_op(src, "aten.ones.default") or (is_op(src, "aten.full.default") and src.args[1] in (1, True))
            if not ok or sv is None or sv.dim() != 2:
                return None
            diag = n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0)
            return ("tril" if "tril" in t else "triu", int(diag), negate, chain + [n, src])
        else:
            return None
        chain.append(n)
        n = src
    return None


def match_rms(mean: fx.Node):
    """x * rsqrt(mean(x^2, -1, keepdim) + eps) [-> cast] [* w]: the decomposed RMSNorm."""
    args = mean.args
    if len(args) < 3 or args[2] is not True or mean.kwargs.get("dtype") is not None or not last_dim(mean, args[1]):
        return None
    p = args[0]
    if not is_op(p, "aten.pow.Tensor_Scalar") or p.args[1] != 2 or sole_user(p) is not mean:
        return None
    xc = p.args[0]
    add = sole_user(mean)
    if not is_op(add, "aten.add.Tensor", "aten.add.Scalar") or add.args[0] is not mean or isinstance(add.args[1], fx.Node):
        return None
    r = sole_user(add)
    if not is_op(r, "aten.rsqrt.default"):
        return None
    m = sole_user(r)
    if not is_op(m, "aten.mul.Tensor") or set(m.args) != {xc, r}:
        return None
    members, cur = [p, mean, add, r, m], m
    c = sole_user(cur)
    if is_op(c, *CASTS) and fusible(c):
        members.append(c)
        cur = c
    o = sole_user(cur)
    if is_op(o, "aten.mul.Tensor"):
        w = o.args[1] if o.args[0] is cur else o.args[0]
        wv = val_of(w)
        if wv is not None and wv.dim() == 1 and wv.shape[0] == val_of(cur).shape[-1] and fusible(o):
            members.append(o)
    if is_op(xc, *CASTS) and fusible(xc) and all(u in members for u in users(xc)):
        members.insert(0, xc)
    if not all(val_of(n) is not None and (val_of(n).dtype in FLOAT_DTYPES) for n in members):
        return None
    return members


def match_rotary(cat: fx.Node):
    """x * cos + cat(-x[..., h:], x[..., :h]) * sin (either operand order) -> members, extra."""
    if len(cat.args) < 2 or len(cat.args[0]) != 2 or not last_dim(cat, cat.args[1]):
        return None
    a, b = cat.args[0]
    if not (is_op(a, "aten.neg.default") and is_op(b, "aten.slice.Tensor")):
        return None
    s1 = a.args[0]
    if not is_op(s1, "aten.slice.Tensor") or s1.args[0] is not b.args[0]:
        return None
    x = b.args[0]
    xv = val_of(x)
    d = xv.shape[-1] if xv is not None else 0
    h = d // 2
    if d < 2 or d % 2 or d & (d - 1):
        return None
    if not (last_dim(x, s1.args[1]) and s1.args[2] == h and s1.args[3] >= d
            and last_dim(x, b.args[1]) and b.args[2] in (0, None) and b.args[3] == h):
        return None
    if any(len(s.args) > 4 and s.args[4] != 1 for s in (s1, b)):
        return None
    if not (sole_user(s1) is a and sole_user(a) is cat and sole_user(b) is cat):
        return None
    u = sole_user(cat)
    w = sole_user(u) if is_op(u, "aten.mul.Tensor") else None
    if not is_op(w, "aten.add.Tensor") or len(w.args) != 2:
        return None
    t = w.args[1] if w.args[0] is u else w.args[0]
    if not is_op(t, "aten.mul.Tensor") or x not in t.args or sole_user(t) is not w:
        return None
    if not all(fusible(n) for n in (u, t, w)) or val_of(w).dtype not in FLOAT_DTYPES:
        return None
    return [s1, a, b, cat, u, t, w], {"rotate": {cat: x}, "skip": {s1, a, b}}
