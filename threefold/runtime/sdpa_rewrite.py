"""compile=inductor: materialised attention -> one scaled_dot_product_attention call.

A model written as `softmax(mask(Q @ K^T * scale)) @ V` (nanoGPT's attention, Hugging Face's
"eager" attention) reaches Inductor as two batched GEMMs with a [B, H, T, S] score tensor
between them: the scores are written, masked, soft-maxed and saved for backward, and the
backward runs two more GEMMs over them plus the softmax's backward. Inductor's own
attention patterns (torch/_inductor/fx_passes/fuse_attention.py) match neither form this
project's chunks carry (a bool buffer through masked_fill, or an additive float mask with
softmax's dtype argument), so on CPU they stay materialised. torch's CPU flash attention
kernel computes the same thing blockwise, forward and backward, without the score tensor.

`rewrite(gm)` runs on the graph Dynamo captured (torch-level aten ops, before AOTAutograd),
so AOTAutograd derives the backward from SDPA's own derivative. It is a rule over the
graph: any chain

    s = matmul(Q, transpose(K, -2, -1))             Q [B, H, T, D], K [B, H, S, D]
    s = mul(s, c) | div(s, c)                       optional, c a Python number
    s = masked_fill(s, ~M, -inf) | add(s, A)        optional: bool keep-mask M, or additive A
    p = softmax(s, -1)                              dtype argument absent or s's own
    p = to(p, same dtype) | dropout(p, 0.0, *) | alias(p)    any number, identities only
    o = matmul(p, V)                                V [B, H, S, Dv]

whose intermediates nothing else reads becomes `o = sdpa(Q, K, V, attn_mask, scale=c)`.
Not rewritten: dropout with p > 0 (SDPA would draw a different mask than eager), a
probability tensor read elsewhere (returned attention weights), masks that need a gradient
(learned biases: the flash kernel gives the mask none), broadcasting batch dimensions, a
mask fill other than -inf (a finite fill changes fully masked rows differently), and any
dtype but float32 (bf16 upcasts its softmax: the chain does not match, by design).

Only chains with at least MIN_KEYS (512) keys: below, the flash kernels cost what they
replace or more (measured below MIN_KEYS), so shorter sequences stay as written.

Same numbers, one difference handled: softmax over a row whose every key is masked is NaN in
eager, while SDPA returns 0 there; the rewrite keeps eager's NaN (a `where` on the output
over the mask's all-masked rows; Inductor fuses it into the transpose that follows).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

_IDENTITY = {aten.alias.default, aten.to.dtype, aten.dropout.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_ASSERT = {aten._assert_tensor_metadata.default}


# Keys per query from which the rewrite pays (one thread, Zen 4, compiled both ways, F+B of
# a whole chunk, bench/compile_chunk.py): 128 keys level (h=256) or 0.3-1.1% slower
# (llama512), 256 keys 0.6-2.3% slower, 512 keys 1.02x, 1024 keys 1.05x (h=256). The attention
# alone gains sooner (1.10-1.13x at 256 keys) than the chunk around it shows.
MIN_KEYS = 512


def rewrite(gm: fx.GraphModule, min_keys: int | None = None) -> int:
    """Replace every matching attention chain of gm with at least min_keys keys (default
    MIN_KEYS) in place; the number replaced."""
    min_keys = MIN_KEYS if min_keys is None else min_keys
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.matmul.default:
            match = _match(node, min_keys)
            if match is not None:
                _replace(gm.graph, node, match)
                count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _val(node):
    """The example tensor Dynamo recorded for a node (None if none or not a tensor)."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value")
    return v if isinstance(v, torch.Tensor) else None


def _users(node: fx.Node) -> list[fx.Node]:
    """A node's readers, metadata assertions (which read but compute nothing) left out."""
    return [u for u in node.users if u.target not in _ASSERT]


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return _users(node) == [user]


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim % ndim == ndim - 1


def _match(pv: fx.Node, min_keys: int):
    """The pieces of an attention chain ending at matmul node pv, or None."""
    p, v = pv.args[0], pv.args[1]
    chain = [pv]
    # identities between softmax and the second matmul
    while isinstance(p, fx.Node) and p.op == "call_function" and p.target in _IDENTITY:
        if not _only_user(p, chain[-1]) or not _is_identity(p):
            return None
        chain.append(p)
        p = p.args[0]
    if not (isinstance(p, fx.Node) and p.op == "call_function" and p.target in _SOFTMAX):
        return None
    if not _only_user(p, chain[-1]):
        return None
    s = p.args[0]
    sval, pval = _val(s), _val(p)
    if sval is None or pval is None or sval.dim() != 4 or not _last_dim(_arg(p, 1, "dim"), 4):
        return None
    if pval.dtype != sval.dtype:   # softmax(x, dtype=...) upcasting: not eager's arithmetic
        return None
    chain.append(p)
    mask, fill_nan = None, False
    if isinstance(s, fx.Node) and s.target in (aten.masked_fill.Scalar, aten.add.Tensor) and not s.kwargs \
            and _only_user(s, chain[-1]):   # (add's alpha= would scale the mask)
        found = _mask(s)
        if found is not None:
            mask, fill_nan = found
            chain.append(s)
            s = s.args[0]
    scale = 1.0
    if isinstance(s, fx.Node) and s.target in (aten.mul.Tensor, aten.div.Tensor) and not s.kwargs \
            and _only_user(s, chain[-1]):
        c = s.args[1]
        if isinstance(c, (int, float)) and not isinstance(c, bool) and c != 0 and math.isfinite(c):
            scale = float(c) if s.target is aten.mul.Tensor else 1.0 / float(c)
            chain.append(s)
            s = s.args[0]
    if not (isinstance(s, fx.Node) and s.target is aten.matmul.default and _only_user(s, chain[-1])):
        return None
    q, kt = s.args
    if not (isinstance(kt, fx.Node) and kt.target is aten.transpose.int and _only_user(kt, s)):
        return None
    k = kt.args[0]
    qv, kv, vv, ov = _val(q), _val(k), _val(v), _val(pv)
    if any(t is None or t.dim() != 4 or not all(isinstance(d, int) for d in t.shape) for t in (qv, kv, vv, ov)):
        return None   # symbolic sizes (a dynamic recompile) are left alone: static shapes only
    if {kt.args[1] % 4, kt.args[2] % 4} != {2, 3} or kv.shape[2] < min_keys:
        return None
    if {t.dtype for t in (qv, kv, vv, sval)} != {torch.float32} or len({t.device for t in (qv, kv, vv)}) != 1:
        return None
    B, H, T, D = qv.shape
    if tuple(kv.shape[:2]) != (B, H) or tuple(vv.shape[:2]) != (B, H) or kv.shape[3] != D \
            or vv.shape[2] != kv.shape[2] or tuple(sval.shape) != (B, H, T, kv.shape[2]):
        return None
    chain += [s, kt]
    return {"q": q, "k": k, "v": v, "mask": mask, "nan_rows": fill_nan, "scale": scale, "chain": chain}


def _is_identity(node: fx.Node) -> bool:
    """to(x, x's dtype), dropout(x, 0.0, ...), alias(x): the same values as their input."""
    if node.target is aten.dropout.default:
        return _arg(node, 1, "p") == 0.0
    if node.target is aten.to.dtype:
        src, out = _val(node.args[0]), _val(node)
        return src is not None and out is not None and src.dtype == out.dtype and len(node.args) <= 2 \
            and not node.kwargs
    return True


def _mask(node: fx.Node):
    """(attn_mask node, whether all-masked rows must be NaN) of a masking op, or None."""
    if node.target is aten.masked_fill.Scalar:
        masked, fill = node.args[1], node.args[2]
        if not (isinstance(fill, float) and fill == -math.inf):
            return None
        mv = _val(masked)
        if mv is None or mv.dtype != torch.bool or mv.requires_grad:
            return None
        # keep-mask = ~masked; ~~M is M itself
        if masked.target is aten.bitwise_not.default and _val(masked.args[0]) is not None:
            return ("keep", masked.args[0]), True
        return ("not", masked), True
    added = node.args[1]
    av = _val(added)
    if av is None or av.requires_grad or av.dtype != torch.float32 or av.dim() > 4:
        return None
    return ("add", added), True


def _replace(graph: fx.Graph, pv: fx.Node, m: dict) -> None:
    with graph.inserting_before(pv):
        mask = None
        keep = None   # bool [.., T, S]: True where a key takes part
        if m["mask"] is not None:
            kind, node = m["mask"]
            if kind == "keep":
                mask = keep = node
            elif kind == "not":
                mask = keep = graph.call_function(aten.bitwise_not.default, (node,))
            else:
                mask = node
                keep = graph.call_function(aten.gt.Scalar, (node, -math.inf))
        out = graph.call_function(
            aten.scaled_dot_product_attention.default, (m["q"], m["k"], m["v"]),
            {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": m["scale"]})
        if keep is not None and m["nan_rows"]:
            # eager's softmax of a row with every key masked is NaN; SDPA's is 0
            alive = graph.call_function(aten.any.dim, (keep, -1, True))
            out = graph.call_function(aten.where.ScalarOther, (alive, out, math.nan))
    pv.replace_all_uses_with(out)
    for node in m["chain"]:
        for user in list(node.users):
            if user.target in _ASSERT:
                graph.erase_node(user)
        graph.erase_node(node)
