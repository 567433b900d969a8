"""cp rules for values carried position by position: pointwise ops, copies, and the runtime ops
cp itself inserts (ring attention, key-side biases, halo convolutions, cuts of the gathered
sequence)."""
from __future__ import annotations

import torch

from threefold.ops import families as fam
from threefold.passes.cp_rules.core import RULES, Call, Gather, Seq, _fail, _val, rule


@rule("getitem")
def _getitem(c: Call):
    s = c.place(c.node.args[0])
    return s[c.node.args[1]] if isinstance(s, tuple) else s


@rule("_assert_tensor_metadata")
def _no_value(c: Call):
    return None


@rule("ring_attention")
def _ring(c: Call):
    """Ring attention rotates key/value blocks along dim -2: q, k and v must be split there."""
    d = c.out.dim() - 2
    if any(not isinstance(c.place(a), Seq) or c.place(a).inner != 1 or c.place(a).dim != _val(a).dim() - 2
           or _val(a).shape[-2] != c.stage.seq_len for a in (c.args["q"], c.args["k"], c.args["v"])):
        _fail(c, "is attention over a dim that is not the split sequence (q, k, v must be split along dim -2)")
    return Seq(d)


@rule("key_bias")
def _key_bias(c: Call):
    """A key-side padding mask: split along its last (key) dim."""
    if any(c.place(a) != Seq(_val(a).dim() - 1) for a in c.node.all_input_nodes):
        _fail(c, "takes a mask that is not split along its key dim")
    return Seq(c.out.dim() - 1)


@rule("causal_conv1d")
def _causal_conv(c: Call):
    s0 = c.place(c.x)
    if s0 is None or s0.dim != _val(c.x).dim() - 1:
        _fail(c, "convolves along a dim that is not the sequence")
    return s0


@rule("shard_seq")
def _shard_seq(c: Call):
    return Seq(c.args["dim"])


@rule(family="pointwise")
def _pointwise(c: Call):
    out = c.out
    several = isinstance(out, (tuple, list))
    out = out[0] if several else out
    r = out.dim() if isinstance(out, torch.Tensor) else 0
    # type_as(x, other) / to(x, other) read only other's dtype and device, not its values
    skip = ("other",) if c.name in ("type_as", "to") else ()
    operands = [a for k, v in c.args.items() if k not in skip for a in (v if isinstance(v, (list, tuple)) else [v])]
    places = {c.place(a).at(c.place(a).dim + r - _val(a).dim()) for a in operands if isinstance(c.place(a), Seq)}
    if len(places) != 1:
        if {p.dim for p in places} == {r - 2, r - 1}:   # a [query, key] grid of positions: computed whole
            return Gather("pairs query positions with key positions (a mask or relative positions for an "
                          "attention cp does not recognise: SDPA, or matmul/einsum, scale, mask, softmax, "
                          "matmul/einsum, run in the ring with sinks, masks of j - i, key padding and biases "
                          "computed from positions and parameters only)")
        _fail(c, "combines values split along different dims")
    s = places.pop()
    d = s.dim
    for a in operands:
        v = _val(a)
        if c.place(a) is None and isinstance(v, torch.Tensor):
            i = d - (r - v.dim())
            if i >= 0 and v.shape[i] != 1:
                _fail(c, "combines the sequence with a value that varies per position but is not computed "
                      "from the inputs (a table sliced to the sequence length?)", a)
    return tuple(s for _ in c.out) if several else s


RULES.update({n: _pointwise for n in fam.COPIES | fam.LIKE_FACTORIES | {"copy", "copy_"}})

# element by element, though ATen does not tag them pointwise: floor_divide (a routing sort's
# row numbers // top_k), polar / complex (rotary tables as complex numbers, DeepSeek-V2),
# real / imag / conj, isin and bucketize (a lookup per element); broadcast_tensors (mse_loss's
# operands brought to one shape: each output laid out as the broadcast of its inputs); the
# bitwise `&`, `|`, `^` of boolean masks
RULES.update({n: _pointwise for n in ("floor_divide", "polar", "complex", "real", "imag", "conj", "isin",
                                      "bucketize", "broadcast_tensors", "__and__", "__or__", "__xor__")})


@rule("new_empty", "new_zeros", "new_ones", "new_full")
def _new_like(c: Call):
    """x.new_empty(size): a fresh value that reads nothing of x. Laid out like x (same rank,
    x's local length on its sequence dim) it is a buffer the model fills position by position
    (DeepSeek's key = k_nope.new_empty(...); key[..., :a] = ...; the copy_ rules check what
    is written): split like x. Of another shape it is a whole value, unless it has the local
    length somewhere (then it would be the wrong size on the whole sequence)."""
    s0, src, out = c.place(c.x), _val(c.x), c.out
    if isinstance(s0, Seq) and out.dim() == src.dim() and out.shape[s0.dim] == src.shape[s0.dim]:
        return s0
    if c.stage.seq_len in tuple(out.shape):
        _fail(c, "makes a value of the local sequence length not laid out like its input")
    return None
