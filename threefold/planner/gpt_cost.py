"""The GPT-2/3 shape's `ModelCost`: Megatron's kernels, fp16, tied embeddings.

The op table's GEMM FLOPs sum to exactly the paper's Eq. 3 (Narayanan et al., SC'21), and
the byte counts are those of Megatron's kernels (fused softmax, bias-GeLU and
bias-dropout-add; unfused attention dropout), which is what makes small-hidden models
slower per FLOP. GPT's activations follow Korthikanti et al. 2022, sec. 4.1 (what Megatron's
layers keep, the paper's measured runs); a Llama-like shape's (--mlp swiglu) are what the
traced graph of that decoder keeps (planner/reference_layer.py), the SPEC path's count.
"""
from __future__ import annotations

from threefold.errors import PlanError
from threefold.planner.model_cost import ACT_BYTES, ModelCost, Op, cross_entropy_bytes


def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """The paper's Eq. 3 (recompute=True) and its variant without recomputation."""
    if recompute:
        return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def gpt_model_cost(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
                   ffn: int | None = None, kv_heads: int | None = None, mlp: str = "gelu",
                   tied: bool = True, attention: str | None = None) -> ModelCost:
    """ModelCost of a decoder (Megatron's kernels, 16-bit): GPT-2/3 by default; `kv_heads`
    (grouped-query attention: K and V projections of kv_heads * head_dim), `mlp="swiglu"`
    (gate and up projections of width `ffn`, then down: Llama, Mistral) and `tied=False`
    (an output projection of its own) describe Llama-like models with the same kernels.
    `attention`: "eager" (the paper's unfused softmax, s^2 scores kept: GPT's default) or
    "flash" (one fused kernel, no s^2 scores: the default with swiglu, as modern models run)."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"model {name}={value!r} is invalid: it must be a positive integer")
    if hidden % heads:
        raise PlanError(f"model hidden={hidden} is not divisible by heads={heads}: choose hidden = heads * head_dim")
    kv = heads if kv_heads is None else kv_heads
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise PlanError(f"--kv-heads {kv_heads} is invalid: it must divide the {heads} attention heads "
                        "(grouped-query attention shares each K/V head among heads/kv_heads query heads)")
    if mlp not in ("gelu", "swiglu"):
        raise PlanError(f"--mlp {mlp!r} is invalid: use gelu (GPT: fc1, GeLU, fc2) or swiglu (Llama: gate, up, down)")
    if ffn is not None and (not isinstance(ffn, int) or ffn < 1):
        raise PlanError(f"--ffn {ffn!r} is invalid: it must be a positive integer (the MLP's intermediate size)")
    attention = attention or ("flash" if mlp == "swiglu" else "eager")
    if attention not in ("eager", "flash"):
        raise PlanError(f"--attention {attention!r} is invalid: use eager (softmax of s x s scores, kept) or flash")
    flash = attention == "flash"
    gpt = kv == heads and mlp == "gelu" and tied and ffn in (None, 4 * hidden) and not flash
    h, s, a, V = hidden, seq, heads, vocab
    f = ffn or 4 * h
    kvh = kv * (h // a)       # width of K (and of V)
    A = a * s                 # attention-score elements per token (all heads)
    B = ACT_BYTES
    gated = mlp == "swiglu"
    up = 2 * f if gated else f   # fc1's output width: gate and up side by side
    qkv = h + 2 * kvh
    # GPT: learned positions and dropout (a 1-byte mask per residual add); the gated
    # (Llama-like) models: rotary embeddings and no dropout
    rotary = gated
    mask = 0 if gated else h
    ops = (
        # name                      flops/token     bytes sharded            bytes replicated    weights
        Op("layernorm1",            bytes_repl=2 * B * h),
        Op("qkv_gemm",              flops_split=2 * h * qkv, bytes_split=B * qkv, bytes_repl=B * h,
           weight_bytes=B * qkv * h, matmul=True),
    ) + ((
        # rotary embeddings: one fused kernel each for q and k (read, write; cos and sin rows)
        Op("rotary_q",              bytes_split=2 * B * h, bytes_repl=2 * B * (h // a)),
        Op("rotary_k",              bytes_split=2 * B * kvh, bytes_repl=2 * B * (h // a)),
    ) if rotary else ()) + ((
        # one fused kernel: reads q, k, v, writes the context; scores never reach memory, so
        # recompute=selective has nothing to rerun (the recompute pass's rule finds no region
        # larger than the residual stream to drop)
        Op("flash_attention",       flops_split=4 * s * h, bytes_split=B * (2 * h + 2 * kvh), matmul=True),
        Op("context_transpose",     bytes_split=2 * B * h),                 # [b,a,s,d] -> [b,s,h]
    ) if flash else (
        Op("scores_bmm",            flops_split=2 * s * h, bytes_split=B * (h + kvh + A), matmul=True, selective=True),
        Op("scale_mask_softmax",    bytes_split=2 * B * A, selective=True),                 # fused: read + write
        Op("attention_dropout",     bytes_split=2 * B * A + A, selective=True),             # read, write, 1-byte mask
        Op("context_bmm",           flops_split=2 * s * h, bytes_split=B * (A + kvh + h), matmul=True, selective=True),
        Op("context_transpose",     bytes_split=2 * B * h),                 # [b,a,s,d] -> [s,b,h]
    )) + (
        Op("dense_gemm",            flops_split=2 * h * h, bytes_split=B * h, bytes_repl=B * h,
           weight_bytes=B * h * h, matmul=True),
        Op("bias_dropout_add1",     bytes_repl=3 * B * h + mask),           # fused: out, residual -> sum, mask
        Op("layernorm2",            bytes_repl=2 * B * h),
        Op("fc1_gemm",              flops_split=2 * h * up, bytes_split=B * up, bytes_repl=B * h,
           weight_bytes=B * h * up, matmul=True),
        # fused activation: GeLU reads and writes f; SwiGLU reads gate and up, writes f
        Op("swiglu" if gated else "bias_gelu", bytes_split=(3 if gated else 2) * B * f),
        Op("fc2_gemm",              flops_split=2 * f * h, bytes_split=B * f, bytes_repl=B * h,
           weight_bytes=B * f * h, matmul=True),
        Op("bias_dropout_add2",     bytes_repl=3 * B * h + mask),
    )
    # gather (GPT: + position, dropout)
    pre = (Op("embedding", bytes_repl=B * h if rotary else 3 * B * h + h),)
    post = (
        Op("final_layernorm", bytes_repl=2 * B * h),
        Op("logits_gemm", flops_split=2 * h * V, bytes_split=B * V, bytes_repl=B * h,
           weight_bytes=B * h * V, matmul=True),
        Op("vocab_parallel_cross_entropy", bytes_split=cross_entropy_bytes(V)),
    )
    # qkv, dense, fc1 (+gate), fc2 with biases, norms: 12h^2+13h for GPT; a Llama-like
    # (swiglu) layer has no biases and two RMSNorm weights of h, and a final norm of h
    layer_params = qkv * h + qkv + h * h + h + up * h + up + f * h + h + 4 * h
    norms_repl = 6 * h                        # 2 norms (2h each), 2 row-parallel biases
    if gated:
        layer_params, norms_repl = qkv * h + h * h + up * h + f * h + 2 * h, 2 * h
    # Korthikanti et al. 2022, sec. 4.1: sbh(10 + 24/t + 5as/(ht)) per layer for GPT; its 24h
    # split part is q (2h), k and v (4 kv_heads*d), the projection's input (2h) and the MLP's
    # GeLU input and output (4f); SwiGLU keeps gate, up and the product (6f)
    act_split = 4 * h + 4 * kvh + (6 if gated else 4) * f
    activations = dict(act_split=act_split + (0 if flash else 5 * A), act_repl=10 * h, act_input=B * h,
                       act_selective_split=act_split, act_selective_repl=10 * h,   # no 5as/(ht)
                       post_act=(B + 4) * V, post_act_split=True)                  # fp16 logits + fp32 softmax
    if gated and flash:
        # A Llama-like model is one threefold compiles from its PyTorch code, not Megatron's
        # hand-written layers: what it keeps for backward is counted as for a SPEC, by
        # planner/saved_bytes.py on the graph of the decoder these flags describe
        # (planner/reference_layer.py), so both descriptions share one count.
        # lazy: start-up: the reference decoder is traced only for swiglu/MoE flags
        from threefold.planner.reference_layer import flags_activations
        activations = flags_activations(h, a, kv, f, V, s, tied)
    return ModelCost(
        name=f"gpt(l={layers},h={hidden},a={heads},V={vocab},s={seq})" if gpt else
             f"decoder(l={layers},h={hidden},a={heads},kv={kv},ffn={f},{mlp},{attention},"
             f"{'tied' if tied else 'untied'},V={vocab},s={seq})",
        layers=layers, seq_len=seq, layer_ops=ops, pre_ops=pre, post_ops=post,
        layer_params=layer_params, layer_params_repl=norms_repl,
        pre_params=V * h, pre_params_repl=s * h if not gated else 0,   # learned positions (GPT); rotary
        post_params=0.0 if tied else V * h, tied_embedding=tied, post_params_repl=h if gated else 0.0,
        tp_allreduce_bytes=2 * B * h, tp_allreduces_per_layer=2,
        boundary_bytes=B * h,
        **activations,
        tp_divides=tuple(sorted({heads, kv, f})),                           # vocab is padded
        # GPT: the paper's Eq. 3 exactly; otherwise the GEMM FLOPs of the op table
        flops_per_iteration_fn=(lambda batch, recompute: eq3_flops(batch, s, layers, h, V, recompute)) if gpt else None,
    )
