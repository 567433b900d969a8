"""The GPT-2/3 shape's `ModelCost`: Megatron's kernels, fp16, tied embeddings.

The op table's GEMM FLOPs sum to exactly the paper's Eq. 3 (Narayanan et al., SC'21), and
the byte counts are those of Megatron's kernels (fused softmax, bias-GeLU and
bias-dropout-add; unfused attention dropout), which is what makes small-hidden models
slower per FLOP. Activations follow Korthikanti et al. 2022, sec. 4.1.
"""
from __future__ import annotations

from threefold.errors import PlanError
from threefold.planner.model_cost import ACT_BYTES, ModelCost, Op


def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """The paper's Eq. 3 (recompute=True) and its variant without recomputation."""
    if recompute:
        return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def gpt_model_cost(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
                   ffn: int | None = None) -> ModelCost:
    """ModelCost of a GPT-2/3 style decoder (Megatron's kernels, fp16, tied embeddings)."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"model {name}={value!r} is invalid: it must be a positive integer")
    if hidden % heads:
        raise PlanError(f"model hidden={hidden} is not divisible by heads={heads}: choose hidden = heads * head_dim")
    h, s, a, V = hidden, seq, heads, vocab
    f = ffn or 4 * h
    A = a * s                 # attention-score elements per token (all heads)
    B = ACT_BYTES
    ops = (
        # name                      flops/token     bytes sharded            bytes replicated    weights
        Op("layernorm1",            bytes_repl=2 * B * h),
        Op("qkv_gemm",              flops_split=2 * h * 3 * h, bytes_split=B * 3 * h, bytes_repl=B * h,
           weight_bytes=B * 3 * h * h, matmul=True),
        Op("scores_bmm",            flops_split=2 * s * h, bytes_split=B * (2 * h + A), matmul=True, selective=True),
        Op("scale_mask_softmax",    bytes_split=2 * B * A, selective=True),                 # fused: read + write
        Op("attention_dropout",     bytes_split=2 * B * A + A, selective=True),             # read, write, 1-byte mask
        Op("context_bmm",           flops_split=2 * s * h, bytes_split=B * (A + 2 * h), matmul=True, selective=True),
        Op("context_transpose",     bytes_split=2 * B * h),                 # [b,a,s,d] -> [s,b,h]
        Op("dense_gemm",            flops_split=2 * h * h, bytes_split=B * h, bytes_repl=B * h,
           weight_bytes=B * h * h, matmul=True),
        Op("bias_dropout_add1",     bytes_repl=3 * B * h + h),              # fused: out, residual -> sum, mask
        Op("layernorm2",            bytes_repl=2 * B * h),
        Op("fc1_gemm",              flops_split=2 * h * f, bytes_split=B * f, bytes_repl=B * h,
           weight_bytes=B * h * f, matmul=True),
        Op("bias_gelu",             bytes_split=2 * B * f),                 # fused
        Op("fc2_gemm",              flops_split=2 * f * h, bytes_split=B * f, bytes_repl=B * h,
           weight_bytes=B * f * h, matmul=True),
        Op("bias_dropout_add2",     bytes_repl=3 * B * h + h),
    )
    pre = (Op("embedding", bytes_repl=3 * B * h + h),)                      # gather, + position, dropout
    post = (
        Op("final_layernorm", bytes_repl=2 * B * h),
        Op("logits_gemm", flops_split=2 * h * V, bytes_split=B * V, bytes_repl=B * h,
           weight_bytes=B * h * V, matmul=True),
        Op("vocab_parallel_cross_entropy", bytes_split=3 * 4 * V),          # fp32: max, exp-sum, normalise
    )
    layer_params = 3 * h * h + 3 * h + h * h + h + 2 * h * f + f + h + 4 * h  # qkv, dense, fc1, fc2, norms: 12h^2+13h
    return ModelCost(
        name=f"gpt(l={layers},h={hidden},a={heads},V={vocab},s={seq})",
        layers=layers, seq_len=seq, layer_ops=ops, pre_ops=pre, post_ops=post,
        layer_params=layer_params, layer_params_repl=6 * h,  # 2 norms (2h each), 2 row-parallel biases
        pre_params=V * h, pre_params_repl=s * h, post_params=0.0, tied_embedding=True,
        tp_allreduce_bytes=2 * B * h, tp_allreduces_per_layer=2,
        boundary_bytes=B * h,
        # Korthikanti et al. 2022, sec. 4.1: sbh(10 + 24/t + 5as/(ht)) per layer.
        act_split=24 * h + 5 * A, act_repl=10 * h, act_input=B * h,
        act_selective_split=24 * h, act_selective_repl=10 * h,             # sbh(10 + 24/t): no 5as/(ht)
        post_act=(B + 4) * V, post_act_split=True,                          # fp16 logits + fp32 softmax
        tp_divides=(heads, f),                                              # vocab is padded
        flops_per_iteration_fn=lambda batch, recompute: eq3_flops(batch, s, layers, h, V, recompute),
    )
