"""cp rules for contractions and lookups (matmuls, einsum, embeddings, index, gather/scatter):
position-wise when the sequence is a batch-like dim of the contraction."""
from __future__ import annotations

import torch
import torch.fx as fx

from threefold.passes.cp_masks import evaluate
from threefold.passes.cp_rules.core import Call, Seq, _fail, _norm, _val, rule


@rule(family="matmul")
def _matmul(c: Call):
    if c.name == "einsum":
        return _einsum(c)
    if c.name == "outer":
        sa, sb = c.place(c.args["self"]), c.place(c.args["vec2"])
        if sa is not None and sb is not None:
            _fail(c, "multiplies two split position vectors")
        return Seq(0) if sa is not None else Seq(1)
    a, b = (c.args["mat1"], c.args["mat2"]) if c.name == "addmm" else \
        (c.args["batch1"], c.args["batch2"]) if c.name == "baddbmm" else \
        (c.args["input"], c.args["weight"]) if c.name == "linear" else (c.args["self"], c.args.get("mat2", c.args.get("other")))
    if c.name in ("addmm", "baddbmm") and isinstance(c.place(c.args["self"]), Seq):
        _fail(c, "adds a split bias to a contraction")
    sa, sb, out = c.place(a), c.place(b), c.out
    ra = _val(a).dim()
    if c.name == "linear" or sb is None:
        if sa is None or (ra > 1 and sa.dim == ra - 1) or (c.name != "linear" and ra == 1):
            _fail(c, "contracts over the sequence")
        return sa.at(sa.dim + out.dim() - ra)
    rb = _val(b).dim()
    if sa is None:
        if sb.dim == rb - 2 or rb == 1:
            _fail(c, "contracts over the sequence")
        if sb.dim == rb - 1:
            return sb.at(out.dim() - 1)
        return sb.at(sb.dim + out.dim() - rb)
    if sa.dim < ra - 2 and sb.dim < rb - 2 and sa.dim - ra == sb.dim - rb:   # both split: a shared batch dim
        return sa.at(sa.dim + out.dim() - ra)
    _fail(c, "contracts over the sequence (attention not recognised as such?)")


def _einsum(c: Call):
    """Position-wise when every split operand carries the sequence under one letter that the
    output keeps and no whole operand varies along."""
    eq, tensors = c.args["equation"].replace(" ", ""), c.args["tensors"]
    ins, _, outs = eq.partition("->")
    subs = ins.split(",")
    free = iter(ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in eq)
    ell = None
    expanded = []
    for s_, t in zip(subs, tensors):
        if "..." in s_:
            k = _val(t).dim() - (len(s_) - 3)
            ell = ell or "".join(next(free) for _ in range(max(k, 0)))
            s_ = s_.replace("...", ell[len(ell) - k:] if k else "")
        expanded.append(s_)
    if not _ and not outs:
        letters = "".join(expanded)
        outs = (ell or "") + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1 and ch not in (ell or "")))
    outs = outs.replace("...", ell or "")
    seq = {(s_[c.place(t).dim], c.place(t).inner) for s_, t in zip(expanded, tensors) if isinstance(c.place(t), Seq)}
    if len(seq) != 1:
        _fail(c, "contracts split operands along different letters")
    letter, inner = seq.pop()
    if letter not in outs:
        _fail(c, "contracts over the sequence")
    if any(c.place(t) is None and letter in s_ and _val(t).shape[s_.index(letter)] != 1
           for s_, t in zip(expanded, tensors)):
        _fail(c, "meets a whole operand along the sequence")
    return Seq(outs.index(letter), inner)


@rule(family="embedding")
def _embedding(c: Call):
    table = c.args.get("weight")
    idx = c.args.get("indices", c.args.get("ids"))
    si = c.place(idx)
    if c.place(table) is not None or si is None:
        _fail(c, "looks up a table that is split along the sequence")
    return si


@rule("index")
def _index(c: Call):
    """x[..., idx, ...] with x split along the sequence at d: exact when the index at d is the
    local identity, arange(n) (HF's padding mask read as mask[batch_idx, kv_idx]; the cp pass
    keeps such an arange local), and no other index varies along it."""
    x, indices = c.args["self"], list(c.args["indices"])
    s0, n = c.place(x), c.stage.seq_len
    split = [i for i, a in enumerate(indices) if isinstance(c.place(a), Seq)]
    if s0 is None and split:                       # table[positions]: a lookup at this rank's positions
        given = [i for i, a in enumerate(indices) if a is not None]
        shapes = [_val(indices[i]).shape for i in given]
        bshape = torch.broadcast_shapes(*shapes)
        places = {c.place(indices[i]).at(c.place(indices[i]).dim + len(bshape) - _val(indices[i]).dim())
                  for i in split}
        if len(places) != 1 or given != list(range(given[0], given[-1] + 1)):
            _fail(c, "indexes a whole value with positions split along different dims")
        p = places.pop()
        return p.at(given[0] + p.dim)
    if not isinstance(s0, Seq) or s0.dim >= len(indices) or not isinstance(indices[s0.dim], fx.Node) or any(
            c.place(i) is not None for i in indices if isinstance(i, fx.Node)):
        _fail(c, "indexes along the sequence")
    try:
        v = evaluate(indices[s0.dim], c.stage)
    except Exception:
        _fail(c, "indexes along the sequence with an index it cannot read")
    varying = [e for e in range(v.dim()) if v.shape[e] == n]
    if len(varying) != 1 or not torch.equal(
            v, torch.arange(n).view([n if e == varying[0] else 1 for e in range(v.dim())]).expand(v.shape)):
        _fail(c, "indexes along the sequence (not with its own positions)")
    given = [i for i, a in enumerate(indices) if a is not None]
    shapes = [_val(indices[i]).shape for i in given]
    bshape = torch.broadcast_shapes(*shapes)
    e = varying[0] + len(bshape) - v.dim()
    if any(len(sh) - len(bshape) + e >= 0 and sh[len(sh) - len(bshape) + e] != 1
           for i, sh in zip(given, shapes) if i != s0.dim):
        _fail(c, "indexes along the sequence with indices that vary along it")
    adjacent = given == list(range(given[0], given[-1] + 1))
    return Seq((given[0] if adjacent else 0) + e)


@rule("gather", "scatter")
def _gather_scatter(c: Call):
    """aten.gather / scatter along a dim other than the sequence, index split like the source;
    a whole table gathered at split positions along the gathered dim; or the runtime's tp
    scatter / gather (dim named too)."""
    s0, d = c.place(c.x), _norm(c.args["dim"], c.out.dim())
    si = c.place(c.args.get("index"))
    if c.name == "gather" and s0 is None and isinstance(si, Seq) and si.dim == d and si.inner == 1:
        return si      # table.gather(d, positions): a lookup at this rank's positions (BERT's token types)
    if s0 is not None and d == s0.dim:
        _fail(c, "gathers or scatters along the sequence")
    others = [c.place(c.args[k]) for k in ("index", "src") if isinstance(c.args.get(k), fx.Node)]
    if isinstance(c.node.target, torch._ops.OpOverload) and any(o != s0 for o in others):
        _fail(c, "gathers with an index split differently from its source")
    return s0


@rule("scatter_blocks", "gather_blocks", "reduce_scatter", "all_gather_seq")
def _tp_seq_ops(c: Call):
    s0, d = c.place(c.x), _norm(c.args["dim"], c.out.dim())
    if s0 is not None and d == s0.dim:
        _fail(c, "splits or gathers along the sequence over tp")
    return s0

