"""The step's gradient collectives on one rank: each bucket's reduction over the ranks that
split the batch (an all-reduce, ZeRO-1's reduce-scatter through the engine's grad-sync hook,
or the shared-memory exchange of CPU ranks on one host), the wait that averages them back
into the parameters' .grad, and the sums of tied and sequence-parallel parameters' gradients.

`PipelineEngine` (runtime/engine.py) runs these as the handlers of the schedule's
ALL_REDUCE_GRADS / REDUCE_SCATTER_GRADS, WAIT_GRADS, TIED_SUM and SP_SUM actions
(runtime/collective_plan.py); they read and update the step's state (`_StepState`).
"""
from __future__ import annotations

import torch

from threefold.runtime import comm
from threefold.runtime.flat_grads import unflatten_into
from threefold.runtime.mesh import BATCH_AXES

_LOCAL = object()   # a reduction's marker: summed through shared memory (runtime/local_reduce.py)


class GradReduce:
    """The gradient handlers of one engine (which it reads: params, collectives, groups,
    the zero=1 hook and the zero>=2 shards, all set before a step runs)."""

    def __init__(self, engine):
        self.engine = engine
        self._local: tuple | None = None   # (LocalExchange or None,) once set up (runtime/local_reduce.py)

    def reduce(self, st, a) -> None:
        """Start reducing one gradient bucket (all-reduce, or ZeRO-1's reduce-scatter)."""
        e = self.engine
        if not st.train:
            return
        fqns = e.collectives.bucket(e.stage, a).fqns
        if e.dp_grad_hook is not None:   # zero=1: reduce-scatter (runtime/zero.py)
            st.reductions.extend(e.dp_grad_hook.start(list(fqns)))
            return
        if e.batch_group is None:
            return
        grads = []
        for f in fqns:   # a parameter without a gradient this step contributes zeros
            p = e.params[f]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket = e.collectives.bucket(e.stage, a)
        if st.local is not None and bucket.axes == BATCH_AXES:   # shared memory: straight into our slot
            key = (bucket.chunk, bucket.index)
            torch.cat([g.reshape(-1) for g in grads], out=st.local.slot(key))
            st.reductions.append((_LOCAL, key, grads))
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        axes = bucket.axes
        group = e.batch_group if axes == BATCH_AXES else e.groups.of(axes)
        if group is None:   # experts under ep = dp: no other rank holds them; average only
            st.reductions.append((None, flat, grads))
            return
        st.reductions.append((comm.all_reduce(flat, group, "gradients", async_op=True), flat, grads))

    def wait(self, st, a) -> None:
        e = self.engine
        if e.sharded is not None:
            e.sharded.finish()
        elif e.dp_grad_hook is not None:
            e.dp_grad_hook.finish(st.reductions)
        else:
            if st.local is not None and (st.loss_deferred or any(r[0] is _LOCAL for r in st.reductions)):
                self._exchange(st)
            for work, flat, grads in st.reductions:
                if work is _LOCAL:
                    flat = st.local.summed(flat)
                elif work is not None:
                    comm.wait(work, "data-parallel gradient all-reduce", e.batch_group)
                unflatten_into(flat, grads, scale=1.0 / e.batch_ranks)
        st.reductions = []

    def _exchange(self, st) -> None:
        """The shared-memory exchange's one collective: every slot is written; it sums the
        loss share on the way (the step's only all-reduce)."""
        if st.loss_deferred:
            carried, what = st.loss_posted[0], "gradients and the loss"
            st.loss_deferred = False
        else:
            carried, what = torch.zeros((), dtype=torch.float64), "gradients"
        st.local.barrier(carried, what)

    def local_exchange(self):
        """This step's shared-memory gradient exchange (runtime/local_reduce.py), or None:
        plain data parallelism over CPU ranks of one host (no pipeline: the loss's group is
        the batch group; no ZeRO: the buckets are all-reduced whole; a GPU job's collectives
        are NCCL's). Set up once, by every rank at the same step (the conditions are the
        plan's and the job's, the same on every rank)."""
        e = self.engine
        if (e.mesh.pp > 1 or e.collectives.zero or e.batch_group is None or e.device.type != "cpu"
                or e.dp_grad_hook is not None or e.sharded is not None):
            return None
        if self._local is None:
            # lazy: start-up: runtime.local_reduce loads only on this path
            from threefold.runtime import local_reduce
            sizes, dtype = local_reduce.batch_buckets(e.collectives.buckets[e.stage], e.params)
            self._local = (local_reduce.open_exchange(e.batch_group, sizes, dtype),)
        return self._local[0]

    def grad_tensor(self, fqn: str) -> torch.Tensor:
        """The gradient this rank holds for a parameter: whole, or its zero>=2 row shard."""
        sharded = self.engine.sharded
        if sharded is not None:
            g = sharded.grad_rows(fqn)
            if g is None:
                s = sharded.rows[fqn]
                g = sharded.grads[fqn] = torch.zeros((s.count, *s.param.shape[1:]) if s.param.dim()
                                                     else (s.count,), device=s.shard.device)
            return g
        p = self.engine.params[fqn]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def tied_sum(self, st, a) -> None:
        """A tied parameter's gradient, summed over the stages holding it."""
        e = self.engine
        fqn, stages = e.collectives.ties[a.mb]
        comm.all_reduce(self.grad_tensor(fqn), e.groups.ties[stages], f"tied gradient {fqn}")

    def sp_sum(self, st, a) -> None:
        """Parameters applied to sequence shards: each tp rank has part of the gradient."""
        e = self.engine
        for fqn in e.collectives.sp:
            p = e.params.get(fqn)
            if p is not None and p.requires_grad and e.groups.tp is not None and (
                    p.grad is not None or e.sharded is not None):
                comm.all_reduce(self.grad_tensor(fqn), e.groups.tp, f"sequence-parallel gradient {fqn}")
