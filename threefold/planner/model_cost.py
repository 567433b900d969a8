"""`ModelCost`: what the planner knows about a model, however it was obtained.

A model is `layers` identical blocks between a `pre` part (embedding, on the first stage)
and a `post` part (final norm, logits, loss, on the last stage). Each part is a list of
kernels (`Op`) costed per token of one forward pass, each quantity marked as split over the
tp ranks or replicated on every one of them. `gpt_cost.gpt_model_cost` builds one from a GPT
shape (Megatron's kernels); `spec_cost.model_cost_from_spec` from a traced program and the
tensor-parallel pass's decisions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from threefold.planner.cluster import Cluster

BYTES_PER_PARAM = 16          # fp16 weight 2 + fp16 grad 2 + fp32 master 4 + Adam m 4 + v 4
GRAD_BYTES = 2                # gradients are all-reduced in fp16
OPTIMIZER_BYTES_PER_PARAM = 32  # Adam step traffic: read/write master, m, v; read grad; write fp16 weight
ACT_BYTES = 2                 # fp16/bf16 activations


def cross_entropy_bytes(vocab: float) -> float:
    """HBM bytes per token of the loss over `vocab` logits (local to a tp rank): the row is
    read three times in fp32 (max, exp-sum, normalise), Megatron's vocab-parallel kernel.
    One fact for both descriptions: the shape flags' loss op and a SPEC's loss node."""
    return 3 * 4 * vocab


@dataclass(frozen=True)
class Op:
    """One kernel of a layer's forward, costed per token (per microbatch for weights).

    `*_split` quantities are divided by the tp degree (the op runs on shards), `*_repl` are
    not (every tp rank does them whole: layer norms, residual adds without sequence
    parallelism, projections the tp pass keeps replicated).
    """
    name: str
    flops_split: float = 0.0      # FLOPs per token, sharded by tp
    bytes_split: float = 0.0      # HBM bytes per token, sharded by tp
    bytes_repl: float = 0.0       # HBM bytes per token, replicated across tp
    weight_bytes: float = 0.0     # bytes of weights read once per microbatch, sharded by tp
    matmul: bool = False          # runs on tensor cores (counts toward Eq. 3's FLOPs)
    flops_repl: float = 0.0       # FLOPs per token every tp rank runs whole
    weight_bytes_repl: float = 0.0  # bytes of replicated weights read once per microbatch
    selective: bool = False       # recompute=selective reruns it in backward (the attention core)

    def seconds(self, tokens: float, tp: int, cluster: Cluster, dtype: str) -> float:
        flops = (self.flops_split / tp + self.flops_repl) * tokens
        moved = ((self.bytes_split / tp + self.bytes_repl) * tokens + self.weight_bytes / tp
                 + self.weight_bytes_repl)
        peak = cluster.peak(dtype) * (cluster.matmul_fraction if self.matmul else 1.0)
        return max(flops / peak, moved / cluster.hbm_bandwidth, cluster.kernel_launch_s)

    @property
    def flops(self) -> float:
        """FLOPs per token of the whole op (all tp ranks together, replicated work once)."""
        return self.flops_split + self.flops_repl


@dataclass(frozen=True)
class ModelCost:
    """All per-token figures are for one forward pass; parameters count elements."""
    name: str
    layers: int
    seq_len: int
    layer_ops: tuple[Op, ...]
    pre_ops: tuple[Op, ...]
    post_ops: tuple[Op, ...]
    layer_params: float               # parameters of one block (all tp ranks together)
    layer_params_repl: float          # of which replicated on every tp rank (norms, some biases)
    pre_params: float                 # embedding parameters, sharded by tp
    pre_params_repl: float            # e.g. position embeddings, replicated
    post_params: float                # output projection when untied (0 when tied to pre), sharded
    tied_embedding: bool              # last stage keeps a copy of the embedding (Megatron)
    tp_allreduce_bytes: float         # per token per layer forward, summed over its all-reduces
    tp_allreduces_per_layer: int      # all-reduces per layer forward (for latency)
    boundary_bytes: float             # activation bytes per token crossing a stage boundary
    act_split: float                  # saved activation bytes per token per layer, sharded
    act_repl: float                   # ... replicated (no sequence parallelism)
    act_input: float                  # bytes per token kept per layer with recomputation
    post_act: float                   # bytes per token the post part keeps (logits, loss)
    post_act_split: bool = True
    tp_divides: tuple[int, ...] = ()  # tp must divide each (attention heads, ...)
    flops_per_iteration_fn: Callable[[int, bool], float] | None = None  # (batch, recompute) -> FLOPs
    post_params_repl: float = 0.0     # replicated post parameters (final norm)
    # recompute=selective: bytes per token a layer keeps when its attention core is recomputed
    # (None: the same as without recomputation, i.e. nothing is selected)
    act_selective_split: float | None = None
    act_selective_repl: float | None = None
    # every layer's MLP is a mixture of experts (planner/moe.MoeLayer): its GEMMs and
    # all-to-alls are priced by planner/moe.moe_seconds, its E x 3hf parameters held E/ep
    moe: object | None = None

    def __post_init__(self):
        if self.act_selective_split is None:
            object.__setattr__(self, "act_selective_split", self.act_split)
        if self.act_selective_repl is None:
            object.__setattr__(self, "act_selective_repl", self.act_repl)

    @property
    def params(self) -> float:
        experts = self.moe.expert_params() if self.moe else 0.0
        return (self.layers * (self.layer_params + experts) + self.pre_params + self.pre_params_repl
                + self.post_params + self.post_params_repl)

    def layer_flops(self) -> float:
        """GEMM FLOPs per token of one layer's forward (all tp ranks together)."""
        return sum(op.flops for op in self.layer_ops if op.matmul)

    def flops_per_iteration(self, batch: int, recompute: bool) -> float:
        """Model FLOPs of one iteration as the paper counts them (Eq. 3 with recomputation)."""
        if self.flops_per_iteration_fn is not None:
            return self.flops_per_iteration_fn(batch, recompute)
        tokens = batch * self.seq_len
        layer = self.layer_flops() * (4 if recompute else 3)
        post = sum(op.flops for op in self.post_ops + self.pre_ops if op.matmul) * 3
        return tokens * (self.layers * layer + post)


@dataclass(frozen=True)
class MoeLayer:
    """Every layer's MLP is this MoE (SwiGLU experts, priced by planner/moe.py); ModelCost.moe."""
    experts: int         # E
    top_k: int           # k
    ffn: int             # f: one expert's intermediate size
    hidden: int          # h

    def expert_params(self) -> float:
        return self.experts * 3 * self.hidden * self.ffn   # gate+up [h, 2f], down [f, h]
