"""Recent Hugging Face causal LMs (transformers 5.x) the first zoo lacked, from tiny local
configs (nothing is downloaded), built as tests/zoo/hf_decoders.py builds its decoders.
Each entry: (config class, model class, config keywords); the comment says what is new in it."""
from __future__ import annotations

import functools

from tests.zoo.hf_decoders import _STD, build

_GQA = dict(_STD, num_key_value_heads=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

RECENT = {
    # interleaved gate_up output slices [..., ::2], per-expert biases, clamped SwiGLU, attention sinks
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(_GQA, head_dim=8, num_local_experts=4,
                num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # q/k RMSNorm per head, softmax top-k MoE in every layer
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_GQA, head_dim=8, **_MOE)),
    # local/global layers, q/k norms, (1 + w) RMSNorm, scaled embeddings
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GQA, head_dim=8, sliding_window=4,
                    query_pre_attn_scalar=8)),
    # OLMo 3: sliding-window layers, q/k norms over the full projection, post-norms
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(_GQA, sliding_window=4)),
    # MoE with multipliers on embeddings, residuals, attention and logits
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(_GQA, num_local_experts=4,
                   num_experts_per_tok=2)),
    # sigmoid router with a correction bias, shared expert, dense first layer, partial rotary
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(_GQA, head_dim=8, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                 topk_group=1)),
    # MoE with a per-expert statistics bias in routing and a shared expert
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(_GQA, moe_num_experts=4, moe_k=2,
                     moe_intermediate_size=32)),
    # EXAONE 4: hybrid sliding/global attention, q/k norms, post-norms
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(_GQA, sliding_window=4)),
    # Seed-OSS: q/k/v biases, head_dim decoupled from hidden size
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(_GQA, head_dim=8, attention_dropout=0.0,
                 residual_dropout=0.0)),
    # Cohere 2: sliding-window layers without rotary on the global ones, parallel block
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(_GQA, sliding_window=4)),
    # Hunyuan MoE: q/k norms after rotary, shared MLP beside routed experts
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(_GQA, head_dim=8, num_experts=4,
                       moe_topk=2)),
    # DeepSeek-V2: MLA with low-rank q and kv, softmax-router MoE, dense first layer
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_STD, num_key_value_heads=4,
                    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                    n_group=1, topk_group=1)),
    # BitNet: sub-layer norms inside attention and MLP (the float training graph)
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", dict(_GQA)),
    # SmolLM3: rotary skipped on every 4th layer (no_rope_layers)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(_GQA, pad_token_id=0)),
    # GLM-4: post-attention and post-MLP norms, fused gate_up chunk, partial rotary
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(_GQA, head_dim=8, pad_token_id=0)),
    # FlexOlmo: OLMo 2 blocks with a routed MoE
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(_GQA, num_experts=4, num_experts_per_tok=2,
                  pad_token_id=0)),
    # Arcee: ReLU^2 MLP without a gate
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(_GQA)),
    # Apertus: xIELU activation (learned parameters), q/k norms
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(_GQA)),
    # Ernie 4.5 dense: interleaved rotary
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(_GQA, head_dim=8)),
    # PhiMoE: sparsemixer routing through a custom autograd.Function (refused: exact backward unknown)
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    # Llama 4 (text): every token's rows repeated per expert ([b*s] tiled E times) and weighted
    # by its router scores, a bmm over stacked experts, a shared expert; chunked and no-rope
    # layers (found by a held-out survey: cp refused the tiling "along the sequence")
    # Doge: a dynamic mask computed from the values through parameters, added to SDPA's mask
    # (cp: no key-side bias the ring can carry; SDPA runs on the gathered sequence)
    "doge": ("DogeConfig", "DogeForCausalLM", dict(_GQA, head_dim=8)),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(_GQA, head_dim=8, num_local_experts=4,
                    num_experts_per_tok=1, intermediate_size_mlp=64, pad_token_id=0)),
    # MiniMax: lightning attention (decayed linear attention over blocks, decay tables as buffers
    # sliced to the block: the whole sequence is one block here) on odd layers, softmax attention
    # on even ones, MoE in every layer
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(_GQA, head_dim=8, num_local_experts=4,
                num_experts_per_tok=2)),
}

MOE = ["gpt_oss", "qwen3_moe", "granitemoe", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "deepseek_v2",
       "flex_olmo", "phimoe", "llama4_text"]

FACTORIES = {arch: functools.partial(build, *RECENT[arch]) for arch in RECENT}
