"""ZeRO-1 (plan zero=1): the optimizer state and the update sharded over the dp_shard group.

(zero=2 and 3 reuse the row shards and this optimizer; runtime/fsdp.py shards the gradients
and parameters. Under HSDP, plan dp_shard < dp, the shards' gradients are summed over the
dp_replicate ranks too.)

Every dp rank of a stage holds the same parameters (its tp shard of them). Each parameter
is split along its first dim into d row ranges (torch.chunk's rule: ceil(R/d) rows each,
the last ones possibly short or empty); dp rank r owns range r. Then, per step:

1. gradients are reduce-scattered over dp in buckets (this hook replaces the engine's dp
   all-reduce): each rank receives the dp-mean of its own rows, in fp32, and the rows it
   does not own are zeroed (so the rank's `p.grad` is exactly its share: a sum of squares
   all-reduced over dp is the true gradient norm);
2. the wrapped torch optimizer steps on row views of the parameters (`RowShard.shard`,
   Parameters sharing the parameter's storage), so its state (AdamW's moments, SGD's
   momentum) exists for 1/d of the rows and the fp32 parameters, which are the master
   weights, are updated in place;
3. the updated rows are all-gathered over dp into every replica's parameters.

Row ranges rather than Megatron's flat buffer: each shard is a rectangular piece of the
parameter, so checkpoints write optimizer state as pieces of the full tensor (the same
keys as zero=0; checkpoint/zero_state.py) and any plan loads it. Any element-wise
optimizer works (AdamW, Adam, SGD with momentum...); one that couples elements across a
tensor (LAMB's per-tensor trust ratio, Shampoo) would see row pieces and is not supported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime import comm
from threefold.runtime.mesh import BATCH_AXES
from threefold.runtime.wrapped_optimizer import WrappedOptimizer

BUCKET_BYTES = 25 * 2**20   # like the engine's all-reduce buckets


@dataclass
class RowShard:
    """One parameter's split over the dp group, and this rank's piece of it."""
    fqn: str
    param: torch.nn.Parameter   # the full local parameter (this rank's tp shard)
    rows: int                   # R: rows along dim 0 (1 for a 0-d parameter)
    width: int                  # elements per row
    per: int                    # ceil(R / d): rows per dp rank, with padding
    start: int                  # this dp rank's first row
    count: int                  # rows it owns (0 <= count <= per)
    shard: torch.nn.Parameter   # rows [start, start + count) of param, sharing its storage

    def rows_of(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.rows, self.width)


def row_range(rows: int, d: int, r: int) -> tuple[int, int, int]:
    """(rows per rank with padding, first row, rows owned) of dp_shard rank r: torch.chunk's
    rule, ceil(rows/d) each, the last ranks possibly short or empty. The one place it lives."""
    per = -(-rows // d)
    start = min(r * per, rows)
    return per, start, max(0, min(rows, start + per) - start)


def split_rows(fqn: str, p: torch.nn.Parameter, d: int, r: int, own: bool = False) -> RowShard:
    """dp_shard rank r's rows of parameter p; `own` (zero=3): the shard gets its own
    storage, since the parameter's is freed between uses."""
    rows = p.shape[0] if p.dim() else 1
    width = p.numel() // rows if rows else 0
    per, start, count = row_range(rows, d, r)
    flat_rows = p.data.view(rows, *p.shape[1:]) if p.dim() else p.data.view(1)
    piece = flat_rows[start:start + count]
    shard = torch.nn.Parameter(piece.clone() if own else piece, requires_grad=True)
    return RowShard(fqn, p, rows, width, per, start, count, shard)


def _buckets(items: list, nbytes) -> list[list]:
    out, cur, size = [], [], 0
    for it in items:
        n = nbytes(it)
        if cur and size + n > BUCKET_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    if cur:
        out.append(cur)
    return out


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, what: str):
    """Started: `out` (1/d of `inp`) receives the sum of every rank's `inp` slice."""
    try:
        return _REDUCE_SCATTER_FLAT(out, inp, group=group, async_op=True)
    except Exception as exc:
        raise comm._fail(f"reduce-scatter of {what} with", group, exc) from None


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, what: str, async_op: bool = False):
    try:
        return _ALL_GATHER_FLAT(out, inp, group=group, async_op=async_op)
    except Exception as exc:
        raise comm._fail(f"all-gather of {what} with", group, exc) from None


# After the reduce-scatter over dp_shard, a row shard still lacks the contributions of the
# ranks that hold the same rows with other data: the replicas (HSDP), the cp ranks (other
# tokens of the same rows) and, for a dense row under ep, the ep ranks (other tokens; an
# expert's rows differ per ep rank). One all-reduce over their product group, not one per axis.
DENSE_ROW_PEERS = "dp_replicate+ep+cp"
EXPERT_ROW_PEERS = "dp_replicate+cp"
ROW_PEER_GROUPS = (DENSE_ROW_PEERS, EXPERT_ROW_PEERS)   # built when the plan has zero >= 1


def row_peer_groups(engine) -> tuple:
    """(dense rows' group, expert rows' group) of the summation above; None: no other rank."""
    return engine.groups.of(DENSE_ROW_PEERS), engine.groups.of(EXPERT_ROW_PEERS)


class ZeroGradSync:
    """The engine's dp gradient hook under zero=1: `start(fqns)` right after the chunk's
    last backward (so it overlaps later backwards, as the all-reduce did), `finish(pending)`
    after the step's last action, before tied and sequence-parallel gradient sums (those
    all-reduce over other groups, which commutes with the dp mean)."""

    def __init__(self, shards: dict[str, RowShard], group, d: int, row_peers: tuple = (None, None),
                 batch_ranks: int | None = None, experts: frozenset = frozenset()):
        self.shards, self.group, self.d = shards, group, d
        # the rows' other contributions (DENSE_ROW_PEERS / EXPERT_ROW_PEERS), summed after
        # the reduce-scatter; the mean is over every rank that splits the batch (dp x cp)
        self.dense_peers, self.expert_peers = row_peers
        self.scale = 1.0 / (batch_ranks or d)
        self.experts = experts

    def start(self, fqns: list[str]) -> list:
        items = [self.shards[f] for f in fqns if f in self.shards and self.shards[f].param.grad is not None]
        if not items or (self.group is None and self.dense_peers is None):
            return []
        pending = []
        dense = [s for s in items if s.fqn not in self.experts]
        expert = [s for s in items if s.fqn in self.experts]
        for bucket in _buckets(dense, lambda s: s.per * s.width * self.d * 4) + \
                _buckets(expert, lambda s: s.per * s.width * self.d * 4):
            span = sum(s.per * s.width for s in bucket)          # one rank's part of the bucket
            send = torch.zeros(self.d, span, dtype=torch.float32, device=bucket[0].param.device)
            off = 0
            for s in bucket:   # rank r's rows of every gradient, padded, side by side
                if not s.param.grad.is_contiguous():   # finish() writes through a view of it
                    s.param.grad = s.param.grad.contiguous()
                g, n = s.rows_of(s.param.grad), s.per * s.width
                for r in range(self.d):
                    rows = g[r * s.per:(r + 1) * s.per]
                    send[r, off:off + rows.numel()].view_as(rows).copy_(rows)
                off += n
            if self.group is None:   # dp_shard of 1 (ep = dp): this rank owns every row
                recv, work = send.view(-1).clone(), None
            else:
                recv = torch.empty(span, dtype=torch.float32, device=send.device)
                work = reduce_scatter_flat(recv, send.view(-1), self.group, "gradients")
            pending.append((work, recv, bucket))
        return pending

    def finish(self, pending: list) -> None:
        for work, recv, bucket in pending:
            if work is not None:
                comm.wait(work, "data-parallel gradient reduce-scatter", self.group)
            peers = self.expert_peers if bucket[0].fqn in self.experts else self.dense_peers
            if peers is not None:   # buckets hold dense or expert rows, never both
                comm.all_reduce(recv, peers, "gradient shards over the ranks holding the same rows")
            off = 0
            for s in bucket:
                g = s.rows_of(s.param.grad)
                mine = recv[off:off + s.count * s.width].view(s.count, s.width)
                g[:s.start].zero_()
                g[s.start:s.start + s.count].copy_(mine).mul_(self.scale)
                g[s.start + s.count:].zero_()
                off += s.per * s.width

    def all_gather_params(self) -> None:
        """Every dp rank's updated rows into every replica's parameters."""
        items = list(self.shards.values())
        if self.group is None or not items:
            return
        for bucket in _buckets(items, lambda s: s.per * s.width * self.d * s.param.element_size()):
            groups: dict = {}
            for s in bucket:                     # one collective per dtype (all fp32 in practice)
                groups.setdefault(s.param.dtype, []).append(s)
            for dtype, ss in groups.items():
                span = sum(s.per * s.width for s in ss)
                mine = torch.zeros(span, dtype=dtype, device=ss[0].param.device)
                off = 0
                for s in ss:
                    mine[off:off + s.count * s.width].copy_(s.shard.detach().reshape(-1))
                    off += s.per * s.width
                every = torch.empty(self.d, span, dtype=dtype, device=mine.device)
                all_gather_flat(every.view(-1), mine, self.group, "updated parameter rows")
                off = 0
                with torch.no_grad():
                    for s in ss:
                        n = s.per * s.width
                        rows = every[:, off:off + n].reshape(self.d * s.per, s.width)[:s.rows]
                        s.rows_of(s.param.data).copy_(rows)
                        off += n


class ZeroOptimizer(WrappedOptimizer):
    """A torch optimizer over this dp rank's row shards (built by `pm.optimizer(...)`).

    `params`: the ParallelModule's parameters or param groups over them (dicts with
    "params" and per-group options), as for the wrapped class."""

    def __init__(self, engine, optimizer_cls, params=None, *args, **kwargs):
        d = engine.mesh.size("dp_shard")
        r = engine.coord.dp_shard
        trainable = engine.named_parameters()
        self.engine = engine
        self.sharded = engine.sharded       # zero>=2: gradients arrive as row shards (runtime/fsdp.py)
        self.shards = (self.sharded.rows if self.sharded is not None
                       else {fqn: split_rows(fqn, p, d, r) for fqn, p in trainable})
        by_id = {id(s.param): s for s in self.shards.values()}
        groups = list(params) if params is not None else [p for _, p in trainable]
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        mapped = []
        for g in groups:
            ps = list(g["params"])
            unknown = [p for p in ps if id(p) not in by_id]
            if unknown:
                raise PlanError("a parameter given to the ZeRO-1 optimizer is not a trainable parameter of this "
                                "ParallelModule: pass pm.parameters() (or groups over them)")
            mapped.append({**g, "params": [by_id[id(p)].shard for p in ps]})
        self.inner = optimizer_cls(mapped, *args, **kwargs)
        self.sync = ZeroGradSync(self.shards, engine.groups.of("dp_shard"), d, row_peer_groups(engine),
                                 engine.mesh.size(BATCH_AXES), engine.manifest.expert_weights())
        if self.sharded is None:
            engine.use_grad_sync(self.sync)

    def row_shards(self) -> dict[str, RowShard]:
        return self.shards

    def grad_of(self, s: RowShard) -> torch.Tensor | None:
        """This rank's rows of one reduced gradient (shaped like the row shard), or None."""
        if self.sharded is not None:
            return self.sharded.grad_rows(s.fqn)
        g = s.param.grad
        return None if g is None else s.rows_of(g)[s.start:s.start + s.count].view_as(s.shard)

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's update reads (its rows of each reduced gradient)."""
        return [g for g in (self.grad_of(s) for s in self.shards.values()) if g is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        for s in self.shards.values():
            g = self.grad_of(s)
            s.shard.grad = None if g is None else g.view_as(s.shard)
        try:
            self.inner.step()
        finally:
            for s in self.shards.values():
                s.shard.grad = None   # the views would keep last step's gradients alive
        if self.sharded is None or self.sharded.zero < 3:   # zero=3 gathers at the next use
            self.sync.all_gather_params()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd) -> None:
        self.inner.load_state_dict(sd)


def held_bytes(engine, optimizer) -> dict:
    """Bytes this rank holds for training state: parameters, gradients and optimizer state
    (each storage counted once), and the trainable elements they serve (for bytes/param)."""
    params = engine.parameters()
    seen: set = set()

    def once(t) -> int:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return 0
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()
    sharded = getattr(engine, "sharded", None)
    extra_params, extra_grads = [], []
    if sharded is not None:   # zero>=2: gradient row shards; zero=3: parameter row shards
        extra_grads = list(sharded.grads.values())
        if sharded.zero >= 3:
            extra_params = [s.shard for s in sharded.rows.values()]
    out = {"params": sum(once(p) for p in list(params) + extra_params),
           "grads": sum(once(g) for g in [p.grad for p in params if p.grad is not None] + extra_grads)}
    inner = getattr(optimizer, "inner", optimizer)
    out["optimizer"] = sum(once(v) for st in inner.state.values() for v in st.values())
    out["elements"] = sum(p.numel() for p in params)
    return out
