"""Tensor-parallel operations that generated code calls (Megatron's f, g and friends).

Each takes the tensor-parallel process group last (`self.tp_group` in generated code);
with group None (one tp rank) every op is the identity. All are autograd functions whose
backward is the matching collective, so the compiled graph stays differentiable.

  f              identity forward, all-reduce backward     (replicated input -> column-parallel)
  g              all-reduce forward, identity backward     (row-parallel output -> replicated)
  scatter        this rank's slice forward, all-gather backward   (replicated -> sharded)
  gather         all-gather forward, slice backward               (sharded -> replicated)
  reduce_scatter reduce-scatter forward, all-gather backward      (partial -> sequence shard)
  all_gather_seq all-gather forward, reduce-scatter backward      (sequence shard -> column input;
                 saved for backward as the shard: runtime/saved_shards.py)
  vocab_parallel_embedding / vocab_parallel_cross_entropy: the vocabulary split over ranks
  tp_dropout     dropout whose mask differs per tp rank (sharded regions; see DESIGN notes)

Under compile=inductor (runtime/compiled.py) Dynamo traces the functions in TRACEABLE into
the chunk's graph instead of breaking the graph at each: while tracing, their collectives
are functional collectives (torch.distributed._functional_collectives), which AOTAutograd
and Inductor keep in the graph in program order, on every rank alike. Eager, they go
through comm (bounded waits that name the group and what failed). A default GPT at tp=2
broke its forward graph at each of 19 calls (every f, g and vocab-parallel op); now none.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from threefold.runtime import comm   # every collective goes through comm: bounded, names its group
from threefold.runtime import saved_shards


class GroupRef:
    """Placeholder for a process group in the compiled graph; codegen writes self.<name>_group."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"GroupRef({self.name!r})"


TP = GroupRef("tp")

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

# What a compiled chunk traces rather than runs eagerly (runtime/compiled.py): the functions
# whose only communication is _all_reduce / _all_gather and whose Python state is the
# arguments. all_gather_seq (saved_shards' hooks) and tp_dropout (a per-rank generator) stay eager.
TRACEABLE = ("f", "g", "scatter", "gather", "reduce_scatter", "scatter_blocks", "gather_blocks",
             "mask_padding", "vocab_parallel_embedding", "vocab_parallel_cross_entropy",
             "vocab_parallel_cross_entropy_full")


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group, op: str = "sum",
                what: str = "a tensor-parallel partial sum") -> torch.Tensor:
    if group is None:
        return x
    if torch.compiler.is_compiling():    # traced into a compiled chunk's graph
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), op, group))
    x = x.contiguous().clone()
    comm.all_reduce(x, group, what, op=_REDUCE_OPS[op])
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group is None:
        return x
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), dim, group))
    parts = [torch.empty_like(x.contiguous()) for _ in range(_size(group))]
    comm.all_gather(parts, x.contiguous(), group, "a tensor-parallel shard")
    return torch.cat(parts, dim=dim)


def _slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group is None:
        return x
    return x.chunk(_size(group), dim=dim)[_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group is None:
        return x
    # gloo has no reduce_scatter: all-reduce then keep this rank's slice (same numbers)
    return _slice(_all_reduce(x, group), dim, group)


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _pad(x: torch.Tensor, dim: int, size, group, zeros: bool = False) -> torch.Tensor:
    """A sequence of `size` rows padded to a multiple of the group's size (uneven sequence
    shards: every rank holds ceil(size/t) rows, the last rank's tail is padding). Values are
    padded with copies of the last row, so whatever runs on the shard (a norm, a division)
    stays finite there; gradients with zeros: padding never reaches the loss."""
    if size is None:
        return x
    extra = -size % _size(group)
    if not extra:
        return x
    if zeros:
        shape = list(x.shape)
        shape[dim] = extra
        tail = x.new_zeros(shape)
    else:
        tail = x.narrow(dim, size - 1, 1).expand(*[extra if d == dim else -1 for d in range(x.dim())])
    return torch.cat([x, tail], dim=dim)


def _unpad(x: torch.Tensor, dim: int, size) -> torch.Tensor:
    return x if size is None or x.shape[dim] == size else x.narrow(dim, 0, size).contiguous()


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size=None):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _slice(_pad(x, dim, size, group), dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _unpad(_all_gather(grad, ctx.dim, ctx.group), ctx.dim, ctx.size), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size=None):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _reduce_scatter(_pad(x, dim, size, group), dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _unpad(_all_gather(grad, ctx.dim, ctx.group), ctx.dim, ctx.size), None, None, None


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size=None):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _unpad(_all_gather(x, dim, group), dim, size)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(_pad(grad, ctx.dim, ctx.size, ctx.group, zeros=True), ctx.dim, ctx.group), None, None, None


class _MaskPadding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dim, size, group):
        ctx.dim, ctx.size, ctx.group = dim, size, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[ctx.dim]
        keep = max(0, min(n, ctx.size - _rank(ctx.group) * n))
        if keep < n:
            grad = grad.clone()
            grad.narrow(ctx.dim, keep, n - keep).zero_()
        return grad, None, None, None


def mask_padding(w, dim, size, group):
    """A weight shard whose entries past `size` along `dim` (over all ranks) are padding
    (heads or features tp does not divide, tp_padding.py): identity forward; their gradient
    is zero, so they stay zero and the padded model stays the model."""
    return _MaskPadding.apply(w, dim, size, group) if group is not None else w


class _GradShare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / _size(ctx.group), None


def grad_share(x, group):
    """A replicated parameter's value where it is applied to whole values while other uses
    apply it to shards: identity forward; backward divides by tp, since the gradient of a
    parameter with shard uses is summed over tp and this use's is the same on every rank."""
    return _GradShare.apply(x, group) if group is not None else x


def f(x, group):
    return _F.apply(x, group) if group is not None else x


def g(x, group):
    return _G.apply(x, group) if group is not None else x


# `size` (sequence parallelism over a length tp does not divide): the true length; shards
# are padded to ceil(size/t) rows and gathers cut the padding off again.
def scatter(x, dim, group, size=None):
    return _Scatter.apply(x, dim, group, size) if group is not None else x


def gather(x, dim, group):
    return _Gather.apply(x, dim, group) if group is not None else x


def reduce_scatter(x, dim, group, size=None):
    return _ReduceScatter.apply(x, dim, group, size) if group is not None else x


def all_gather_seq(x, dim, group, size=None):
    """The all-gather of sequence shards; what autograd saves of it is the shard
    (runtime/saved_shards.py: backward gathers again, as Megatron does). A padded gather
    (size given) is saved whole: it is a cut copy, not the gather's own tensor."""
    if group is None:
        return x
    full = _AllGatherSeq.apply(x, dim, group, size)
    if size is None or x.shape[dim] * _size(group) == size:
        saved_shards.register(full, x, dim, group, _all_gather)
    return full


def vocab_parallel_embedding(weight, ids, group, seq_dim=None, padding_idx=-1, size=None):
    """Embedding with the vocabulary split across ranks: each rank looks up the ids that
    fall in its row range (others masked to zero), then the partial results are summed
    (all-reduce; or reduce-scatter along seq_dim under sequence parallelism).
    `padding_idx` (global; -1 for none) keeps its row's gradient at zero, as in nn.Embedding."""
    rows = weight.shape[0]
    start = _rank(group) * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    local_pad = padding_idx - start if padding_idx >= 0 and 0 <= padding_idx - start < rows else -1
    out = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0), local_pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    if seq_dim is not None:
        return reduce_scatter(out, seq_dim, group, size)
    return g(out, group)


def vocab_parallel_cross_entropy(logits, target, ignore_index, vocab, group, dtype=None):
    """Mean cross-entropy of (N, V/t) logit shards against (N,) targets."""
    return vocab_parallel_cross_entropy_full(logits, target, ignore_index, vocab, 0.0, "mean", group, dtype)


def tp_dropout(x, p: float, train: bool, group, seed: int = 2718):
    """Dropout in a tensor-parallel region: a generator seeded per tp rank, so the shards of
    one tensor get independent masks (Megatron's model-parallel RNG), while dropout in
    replicated regions keeps using the shared default generator."""
    if not train or p == 0.0:
        return x
    gen = _generators.get((x.device, _rank(group)))
    if gen is None:
        gen = torch.Generator(device=x.device).manual_seed(seed + _rank(group))
        _generators[(x.device, _rank(group))] = gen
    keep = torch.rand(x.shape, generator=gen, device=x.device) >= p
    return x * keep / (1.0 - p)


_generators: dict = {}


# ---- block-strided layouts and redistribution (sharding-propagation fallback) ----------
# A dim made of equal-or-unequal pieces (`blocks`, global sizes) is sharded piece by piece:
# this rank holds the rank-th 1/t of every piece, concatenated. Fused projections ([q|k|v])
# and merged dims (Bloom's [batch*heads]: blocks (heads,)*batch) have this layout.

def _block_slice(x: torch.Tensor, dim: int, blocks, group) -> torch.Tensor:
    if group is None:
        return x
    t, r = _size(group), _rank(group)
    return torch.cat([p.chunk(t, dim=dim)[r] for p in x.split(list(blocks), dim=dim)], dim=dim).contiguous()


def _block_gather(x: torch.Tensor, dim: int, blocks, group) -> torch.Tensor:
    if group is None:
        return x
    t = _size(group)
    local = [b // t for b in blocks]
    parts = [p.split(local, dim=dim) for p in _all_gather(x, dim, group).split(x.shape[dim], dim=dim)]
    return torch.cat([parts[r][i] for i in range(len(local)) for r in range(t)], dim=dim)


class _ScatterBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, blocks, group):
        ctx.dim, ctx.blocks, ctx.group = dim, blocks, group
        return _block_slice(x, dim, blocks, group)

    @staticmethod
    def backward(ctx, grad):
        return _block_gather(grad, ctx.dim, ctx.blocks, ctx.group), None, None, None


class _GatherBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, blocks, group):
        ctx.dim, ctx.blocks, ctx.group = dim, blocks, group
        return _block_gather(x, dim, blocks, group)

    @staticmethod
    def backward(ctx, grad):
        return _block_slice(grad, ctx.dim, ctx.blocks, ctx.group), None, None, None


def scatter_blocks(x, dim, blocks, group):
    """This rank's 1/t of every block of `dim` (replicated -> block-sharded); backward all-gathers."""
    return _ScatterBlocks.apply(x, dim, tuple(blocks), group) if group is not None else x


def gather_blocks(x, dim, blocks, group):
    """All-gather a block-sharded `dim` back into the global block order; backward slices."""
    return _GatherBlocks.apply(x, dim, tuple(blocks), group) if group is not None else x


class _VocabParallelCEFull(torch.autograd.Function):
    """Cross-entropy over vocab-sharded [N, V/t] logits with every option of F.cross_entropy
    but class weights: reduction mean / sum / none, ignore_index and label_smoothing.

    Smoothed loss per row: (1-e) * (lse - z_target) + e * (lse - mean_c z_c) over the real
    (unpadded) vocabulary; its gradient is softmax - (1-e) * onehot - e / V on real columns.
    Per-row max, then (target logit, sum of exp, sum of logits) in one all-reduce."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, vocab, smoothing, reduction, group):
        n_local = logits.shape[-1]
        start = _rank(group) * n_local
        logits = logits.float()
        valid_cols = (torch.arange(n_local, device=logits.device) + start) < vocab
        masked = logits.masked_fill(~valid_cols, float("-inf"))
        row_max = masked.max(dim=-1).values
        if group is not None:
            row_max = _all_reduce(row_max, group, "max", "the vocab-parallel row max")
        shifted = masked - row_max.unsqueeze(-1)
        local_t = target - start
        in_range = (local_t >= 0) & (local_t < n_local)
        picked = shifted.gather(-1, local_t.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~in_range, 0.0)
        exp = shifted.exp()
        # The sum of logits is needed only for label smoothing: without it, two numbers per row.
        parts = [picked, exp.sum(dim=-1)]
        if smoothing:
            parts.append(shifted.masked_fill(~valid_cols, 0.0).sum(dim=-1))
        sums = torch.stack(parts)
        if group is not None:
            sums = _all_reduce(sums, group)
        picked, sum_exp = sums[0], sums[1]
        sum_shifted = sums[2] if smoothing else 0.0
        lse = sum_exp.log()
        loss = (1.0 - smoothing) * (lse - picked) + smoothing * (lse - sum_shifted / vocab)
        keep = target != ignore_index
        loss = loss.masked_fill(~keep, 0.0)
        count = keep.sum().clamp(min=1)
        ctx.save_for_backward(exp, sum_exp, local_t, in_range, keep, count, valid_cols)
        ctx.n_local, ctx.smoothing, ctx.vocab, ctx.reduction = n_local, smoothing, vocab, reduction
        if reduction == "mean":
            return loss.sum() / count
        return loss.sum() if reduction == "sum" else loss

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, local_t, in_range, keep, count, valid_cols = ctx.saved_tensors
        probs = exp / sum_exp.unsqueeze(-1)
        onehot = torch.zeros_like(probs)
        onehot.scatter_(-1, local_t.clamp(0, ctx.n_local - 1).unsqueeze(-1),
                        in_range.unsqueeze(-1).to(probs.dtype))
        d = probs - (1.0 - ctx.smoothing) * onehot - valid_cols.to(probs.dtype) * (ctx.smoothing / ctx.vocab)
        row = keep.to(probs.dtype) * grad   # grad: a scalar (mean, sum) or one per row (none)
        if ctx.reduction == "mean":
            row = row / count
        return d * row.unsqueeze(-1), None, None, None, None, None, None


def vocab_parallel_cross_entropy_full(logits, target, ignore_index, vocab, smoothing, reduction,
                                      group, dtype=None):
    """F.cross_entropy(reduction, ignore_index, label_smoothing) of (N, V/t) logit shards."""
    loss = _VocabParallelCEFull.apply(logits, target, ignore_index, vocab, float(smoothing), reduction, group)
    return loss.to(dtype) if dtype is not None else loss
