"""Context-parallel operations that generated code calls (plan `cp=N`).

Every sequence is cut into 2N blocks; cp rank r holds blocks r and 2N-1-r (in that order),
so under causal attention every rank does the same work: the early block attends to few
keys, the late one to many (Megatron-Core's and torchtitan's load balance). The group is
the module's cp group (`self.cp_group` in generated code); with group None (cp=1) every op
is the single-process one.

  local_blocks   this rank's two blocks of a global tensor along a dim (the runtime's input split)
  positions      this rank's global positions: what `arange(n)` over the sequence means here
  ring_attention exact attention of the local queries against every rank's keys and values:
                 K/V blocks travel around the ring (p2p, the next block in flight while this one
                 is computed), softmax merged online through the log-sum-exp; the backward goes
                 around the ring again carrying the dK/dV accumulators with their K/V
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from threefold.runtime import comm


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def block_positions(n_local: int, cp: int, r: int, device=None, dtype=torch.int64) -> torch.Tensor:
    """Global positions of the n_local tokens cp rank r holds (blocks r and 2cp-1-r)."""
    if cp == 1:
        return torch.arange(n_local, device=device, dtype=dtype)
    b = n_local // 2
    return torch.cat([torch.arange(r * b, (r + 1) * b, device=device, dtype=dtype),
                      torch.arange((2 * cp - 1 - r) * b, (2 * cp - r) * b, device=device, dtype=dtype)])


def seq_tail(length: int, cp: int) -> int:
    """Positions a sequence of `length` is padded by at the end so 2cp equal blocks cut it: the
    padded length is ceil(length / 2cp) * 2cp, and the last `seq_tail` positions of the whole
    sequence stand for nothing (passes/cp_tails.py: what reads them is made exact)."""
    return -length % (2 * cp) if cp > 1 else 0


def pad_to_blocks(t: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """t padded with zeros at the end of `dim` to a multiple of 2cp positions (seq_tail): the
    one place an uneven sequence becomes cp's padded one (the runtime's cut and the compiler's
    trace both call it). Zeros are a valid token id, a hidden key of a boolean mask and a
    neutral number; what they stand for never reaches a real position."""
    tail = seq_tail(t.shape[dim], cp)
    if not tail:
        return t
    shape = list(t.shape)
    shape[dim] = tail
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=dim)


def local_blocks(t: torch.Tensor, dim: int, cp: int, r: int) -> torch.Tensor:
    """Rank r's share of a global tensor along `dim`: blocks r and 2cp-1-r of 2cp (a length
    2cp does not divide is padded first, pad_to_blocks)."""
    if cp == 1:
        return t
    parts = pad_to_blocks(t, dim, cp).chunk(2 * cp, dim=dim)
    return torch.cat([parts[r], parts[2 * cp - 1 - r]], dim=dim)


def positions(n: int, group, device=None, dtype=torch.int64, layout=None, pin_memory=None,
              limit: int | None = None) -> torch.Tensor:
    """`arange(n)` over a sequence of which this rank holds n positions: their global indices.
    `limit`: the real length of a padded sequence (seq_tail); the padded positions read as
    limit - 1, so a table of exactly `limit` rows is never indexed past its end (what they
    read stands for nothing)."""
    pos = block_positions(n, _size(group), _rank(group), device=device, dtype=dtype or torch.int64)
    return pos if limit is None else pos.clamp(max=limit - 1)


# -- ring attention -------------------------------------------------------------------------

def _block(q, k, v, scale, allowed, bias=None, cap=None):
    """Attention of q against one K/V block: (output, log-sum-exp per query); rows with no
    allowed key give output 0 and lse -inf. `bias` is added to the scores (-inf hides)."""
    s = _scores(q, k, scale, allowed, bias, cap)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    return torch.matmul(p, v), lse


def _scores(q, k, scale, allowed, bias, cap=None):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if cap is not None:   # logit soft-capping (Gemma 2): cap * tanh(s / cap), before the mask
        s = torch.tanh(s / cap) * cap
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def relative_bias(qpos: torch.Tensor, kpos: torch.Tensor, rel, dtype) -> torch.Tensor:
    """The additive bias of a mask that depends on d = j - i only (passes/context_parallel.py
    fits it at compile time): slope[l] * d + intercept[l] per leading index l (ALiBi), -inf
    where d < lo or d > hi (causal, sliding windows). [*lead, len(qpos), len(kpos)]."""
    lo, hi, slopes, intercepts, lead = rel
    d = kpos[None, :] - qpos[:, None]
    shape = tuple(lead) + (1, 1)
    slope = torch.tensor(slopes, dtype=dtype, device=qpos.device).reshape(shape)
    icpt = torch.tensor(intercepts, dtype=dtype, device=qpos.device).reshape(shape)
    bias = slope * d.to(dtype) + icpt
    hidden = torch.zeros_like(d, dtype=torch.bool)
    if lo is not None:
        hidden |= d < lo
    if hi is not None:
        hidden |= d > hi
    return bias.masked_fill(hidden, float("-inf"))


def key_bias(pieces: list, kinds: list) -> torch.Tensor:
    """The key-side part of an attention mask (a padding mask from an input, [..., 1, n]) as
    one additive bias: 'add' pieces as they are, 'visible' / 'hidden' bools as 0 / -inf. It
    travels around the ring with its keys."""
    total = None
    for p, kind in zip(pieces, kinds):
        if kind != "add":
            hide = ~p if kind == "visible" else p
            p = torch.zeros(p.shape, dtype=torch.float32, device=p.device).masked_fill(hide, float("-inf"))
        total = p if total is None else total + p
    return total


def _merge(out, lse, o, l):
    """Online softmax: combine two partial attentions over disjoint key sets."""
    new = torch.logaddexp(lse, l)
    new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return out * torch.exp(lse - new_safe) + o * torch.exp(l - new_safe), new


def _pieces(step: int, r: int, cp: int, n: int, causal: bool):
    """Which queries meet which keys at ring step `step` (keys from rank (r-step) % cp), under
    the load-balanced layout: (query slice, key slice, mask or 'diag' or None). Off the diagonal
    step a causal block is either wholly visible or wholly hidden, half by half."""
    full = slice(0, n)
    if not causal:
        return full, full, None
    src = (r - step) % cp
    b = n // 2
    if src == r:
        return full, full, "diag"
    if src < r:          # the source's early block is before both of ours; its late one after both
        return full, slice(0, b), None
    return slice(b, n), full, None   # our late block is after both of the source's; our early one before


def _diag_mask(n: int, cp: int, r: int, device) -> torch.Tensor:
    pos = block_positions(n, cp, r, device=device)
    return pos[None, :] <= pos[:, None]


class _Ring:
    """Async p2p along the cp ring: send to the next rank, receive from the previous."""

    def __init__(self, group):
        self.group, self.cp, self.r = group, _size(group), _rank(group)
        if group is not None:   # None: a ring of one (the memory model's fake run)
            self.next = dist.get_global_rank(group, (self.r + 1) % self.cp)
            self.prev = dist.get_global_rank(group, (self.r - 1) % self.cp)

    def shift(self, tensors: list[torch.Tensor], what: str):
        """Post sends of `tensors` and receives of same-shaped ones; wait() gives those."""
        sent = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in sent]
        try:
            works = [dist.isend(t, dst=self.next, group=self.group) for t in sent]
            works += [dist.irecv(t, src=self.prev, group=self.group) for t in got]
        except Exception as exc:
            raise comm._fail(f"ring attention: exchanging {what} with", self.group, exc) from None

        def wait():
            try:
                for w in works:
                    w.wait()
            except Exception as exc:
                raise comm._fail(f"ring attention: exchanging {what} with", self.group, exc) from None
            return got
        return wait


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, group, kbias=None, rel=None, cap=None, sink=None, limit=None, *pbias):
        ring = _Ring(group)
        cp, r, n = ring.cp, ring.r, q.shape[-2]
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
        kv = [k, v] + ([kbias] if kbias is not None else [])
        for step in range(cp):
            wait = ring.shift(kv, "keys and values") if step < cp - 1 else None   # next block in flight
            qs, ks, mask = _pieces(step, r, cp, n, causal)
            allowed = _diag_mask(n, cp, r, q.device) if mask == "diag" else None
            bias = _step_bias(kv, rel, step, r, cp, n, qs, ks, q, pbias, limit)
            o, l = _block(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], scale, allowed, bias, cap)
            out[..., qs, :], lse[..., qs, :] = _merge(out[..., qs, :], lse[..., qs, :], o, l)
            if wait is not None:
                kv = wait()
        if sink is not None:   # a sink logit per query with a zero value (gpt-oss): one more key, after the ring
            out, lse = _merge(out, lse, torch.zeros_like(out), sink.to(lse.dtype).expand_as(lse))
        ctx.sink = sink is not None
        ctx.npbias = len(pbias)
        ctx.save_for_backward(q, k, v, out, lse, *([kbias] if kbias is not None else []),
                              *([sink] if sink is not None else []), *pbias)
        ctx.scale, ctx.causal, ctx.group, ctx.rel, ctx.cap, ctx.limit = scale, causal, group, rel, cap, limit
        return out

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, dout):
        q, k, v, out, lse, *kb = ctx.saved_tensors
        pbias = kb[len(kb) - ctx.npbias:]   # position-bias blocks, one per ring step (runtime/cp_bias.py)
        kb = kb[:len(kb) - ctx.npbias]
        sink = kb.pop() if ctx.sink else None
        dpbias = [torch.zeros_like(b) for b in pbias]
        scale, causal, rel, cap = ctx.scale, ctx.causal, ctx.rel, ctx.cap
        ring = _Ring(ctx.group)
        cp, r, n = ring.cp, ring.r, q.shape[-2]
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = [k, v] + kb
        acc = [torch.zeros_like(k), torch.zeros_like(v)]   # dK, dV of the block we hold
        for step in range(cp):
            wait_kv = ring.shift(kv, "keys and values (backward)") if step < cp - 1 else None
            qs, ks, mask = _pieces(step, r, cp, n, causal)
            kb_, vb = kv[0][..., ks, :], kv[1][..., ks, :]
            qb, dob = q[..., qs, :], dout[..., qs, :]
            allowed = _diag_mask(n, cp, r, q.device) if mask == "diag" else None
            s = _scores(qb, kb_, scale, allowed, _step_bias(kv, rel, step, r, cp, n, qs, ks, q, pbias, ctx.limit), cap)
            p = torch.exp(s - lse[..., qs, :])
            dv = torch.matmul(p.transpose(-2, -1), dob)
            ds = p * (torch.matmul(dob, vb.transpose(-2, -1)) - delta[..., qs, :])
            if pbias:   # the bias is added to the final scores: its gradient is ds, summed where broadcast
                at = dpbias[step][..., qs, ks]
                dpbias[step][..., qs, ks] = at + _reduce_to(ds, at.shape).to(at.dtype)
            if cap is not None:   # through cap * tanh(raw / cap): d/draw = 1 - tanh^2
                ds = ds * (1 - torch.tanh(torch.matmul(qb, kb_.transpose(-2, -1)) * scale / cap) ** 2)
            dq[..., qs, :] += torch.matmul(ds, kb_) * scale
            dk = torch.matmul(ds.transpose(-2, -1), qb) * scale
            acc[0][..., ks, :] += _reduce_to(dk, acc[0][..., ks, :].shape)
            acc[1][..., ks, :] += _reduce_to(dv, acc[1][..., ks, :].shape)
            # the accumulators travel with their block: one more hop after the last step
            # brings each rank its own dK, dV
            if cp > 1:
                acc = ring.shift(acc, "key and value gradients")()
            if wait_kv is not None:
                kv = wait_kv()
        dsink = None
        if sink is not None:   # d lse / d sink = p_sink; the sink's value is 0: d sink = -p_sink * delta
            dsink = _reduce_to(-(torch.exp(sink.to(lse.dtype).expand_as(lse) - lse) * delta), sink.shape)
        return dq, _reduce_to(acc[0], k.shape), _reduce_to(acc[1], v.shape), None, None, None, None, None, None, \
            dsink, None, *dpbias


def _step_bias(kv: list, rel, step: int, r: int, cp: int, n: int, qs: slice, ks: slice, q: torch.Tensor,
               pbias=(), limit=None):
    """The additive mask of ring step `step` for its (query, key) slices: the relative-position
    part from global positions (keys of rank (r-step) mod cp), plus the key-side bias that
    travelled with the keys, plus the step's position-bias block (runtime/cp_bias.py), plus
    -inf on the keys at global positions >= `limit` (the padding of an uneven sequence,
    seq_tail: those keys do not exist); None when there is none."""
    bias = pbias[step][..., qs, ks].to(q.dtype) if pbias else None
    if limit is not None:
        kpos = block_positions(n, cp, (r - step) % cp, device=q.device)[ks]
        pad = torch.zeros(kpos.shape, dtype=q.dtype, device=q.device).masked_fill(kpos >= limit, float("-inf"))
        bias = pad if bias is None else bias + pad
    if rel is not None:
        qpos = block_positions(n, cp, r, device=q.device)[qs]
        kpos = block_positions(n, cp, (r - step) % cp, device=q.device)[ks]
        rb = relative_bias(qpos, kpos, rel, q.dtype)
        bias = rb if bias is None else bias + rb
    if len(kv) > 2:
        kb = kv[2][..., ks].to(q.dtype)
        bias = kb if bias is None else bias + kb
    return bias


def _reduce_to(g: torch.Tensor, shape) -> torch.Tensor:
    """Sum a gradient over the dims its input was broadcast along (k, v shared across q's batch dims)."""
    if tuple(g.shape) == tuple(shape):
        return g
    while g.dim() > len(shape):
        g = g.sum(0)
    for d, s in enumerate(shape):
        if s == 1 and g.shape[d] != 1:
            g = g.sum(d, keepdim=True)
    return g


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   group, ranks: int = 1, kbias: torch.Tensor | None = None, rel=None,
                   softcap: float | None = None, sink: torch.Tensor | None = None,
                   pbias: list | None = None, limit: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [causal over global positions]) v over the whole sequence, with
    q, k, v [..., n_local, d] this rank's blocks. `ranks` is the cp size the code was compiled
    for (the cost model reads it). Saved for backward: q, k, v, the output and the
    log-sum-exp, never the n x n probabilities. A mask comes as `rel` (a bias of j - i from
    global positions, see relative_bias) and `kbias` (an additive key-side bias [..., 1, n],
    e.g. padding; it travels with K/V); `causal` then says the mask hides at least the
    future, so the ring skips the blocks causality hides. `softcap`: the scores are
    softcap * tanh(scores / softcap) before the mask (Gemma 2). `sink` [..., n, 1]: a logit per
    query for one more key whose value is zero (attention sinks, gpt-oss). `pbias`: one
    additive bias block [..., n, n] per ring step, a function of (query, key) positions and
    parameters evaluated for this rank's queries and the keys of that step (runtime/cp_bias.py);
    its gradient flows back to whatever computed it. `limit`: the real length of a padded
    sequence (seq_tail): keys at global positions >= limit are hidden from every query (a
    non-causal mask; a causal one hides them from the real queries already)."""
    if group is not None and _size(group) != ranks:
        raise RuntimeError(f"ring attention was compiled for cp={ranks} but runs on a group of {_size(group)}")
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    # bf16/fp16 (autocast): scores, softmax and the log-sum-exp in fp32, as eager softmax under
    # autocast; the result in the compute dtype
    work = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    with torch.autocast(q.device.type, enabled=False):
        # group None: one rank's view (cp=1, or the memory model running the op alone on
        # fakes): the same autograd function, so it saves what a real rank saves
        o = _RingAttention.apply(q, k, v, scale, causal, group, kbias, rel, softcap,
                                 sink.to(work) if sink is not None else None, limit, *(pbias or ())[:_size(group)])
    return o.to(dtype)


# -- causal convolution over time ------------------------------------------------------------

class _Halo(torch.autograd.Function):
    """The `width` positions before each of this rank's two blocks (time is the last dim).

    Block r's predecessor is rank r-1's first block (none at r=0); block 2cp-1-r's is rank
    r+1's second block, or at r=cp-1 this rank's own first block. Backward returns each
    halo's gradient to the rank it came from."""

    @staticmethod
    def forward(ctx, x, width, group):
        ring = _Ring(group)
        cp, r, b = ring.cp, ring.r, x.shape[-1] // 2
        tail1, tail2 = x[..., b - width:b].contiguous(), x[..., 2 * b - width:].contiguous()
        h1, h2 = torch.zeros_like(tail1), tail1.clone()
        works = []
        if r < cp - 1:
            works += [dist.isend(tail1, dst=ring.next, group=group), dist.irecv(h2, src=ring.next, group=group)]
        if r > 0:
            works += [dist.isend(tail2, dst=ring.prev, group=group), dist.irecv(h1, src=ring.prev, group=group)]
        _wait(works, group, "convolution halos")
        ctx.width, ctx.group, ctx.shape = width, group, x.shape
        return h1, h2

    @staticmethod
    def backward(ctx, g1, g2):
        ring = _Ring(ctx.group)
        cp, r, width = ring.cp, ring.r, ctx.width
        b = ctx.shape[-1] // 2
        g1, g2 = g1.contiguous(), g2.contiguous()
        dx = torch.zeros(ctx.shape, dtype=g1.dtype, device=g1.device)
        back1, back2 = torch.zeros_like(g1), torch.zeros_like(g2)   # grads of our tails, from peers
        works = []
        if r > 0:     # h1 came from r-1's first tail; our second tail went to r-1
            works += [dist.isend(g1, dst=ring.prev, group=ctx.group), dist.irecv(back2, src=ring.prev, group=ctx.group)]
        if r < cp - 1:  # h2 came from r+1's second tail; our first tail went to r+1
            works += [dist.isend(g2, dst=ring.next, group=ctx.group), dist.irecv(back1, src=ring.next, group=ctx.group)]
        _wait(works, ctx.group, "convolution halo gradients")
        if r == cp - 1:
            back1 = g2          # our second block's halo was our own first tail
        dx[..., b - width:b] += back1
        dx[..., 2 * b - width:] += back2
        return dx, None, None


def _wait(works, group, what: str) -> None:
    try:
        for w in works:
            w.wait()
    except Exception as exc:
        raise comm._fail(f"context parallelism: exchanging {what} with", group, exc) from None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias, groups: int, group, ranks: int = 1) -> torch.Tensor:
    """conv1d(x, padding=k-1)[..., :n] (a causal convolution over time, the last dim) on this
    rank's two blocks: each block is extended by the k-1 positions before it (a halo from
    the rank that holds them, zeros at the start of the sequence)."""
    width = weight.shape[-1] - 1
    if group is None:   # the whole sequence (or one rank's view in the memory model)
        return F.conv1d(F.pad(x, (width, 0)), weight, bias, groups=groups)
    if _size(group) != ranks:
        raise RuntimeError(f"causal_conv1d was compiled for cp={ranks} but runs on a group of {_size(group)}")
    b = x.shape[-1] // 2
    h1, h2 = _Halo.apply(x, width, group)
    y1 = F.conv1d(torch.cat([h1, x[..., :b]], -1), weight, bias, groups=groups)
    y2 = F.conv1d(torch.cat([h2, x[..., b:]], -1), weight, bias, groups=groups)
    return torch.cat([y1, y2], -1)
