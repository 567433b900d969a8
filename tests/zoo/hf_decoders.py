"""Hugging Face decoder-only LMs built from tiny local configs (nothing is downloaded).

Each entry: (config class, model class, config keywords). Every config gets vocab, max
positions, use_cache=False, eager attention and zero dropout.
"""
from __future__ import annotations

import functools

import torch

from tests.zoo.common import HIDDEN, LAYERS, VOCAB, LogitsOnly, token_batch, workload

_STD = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4)

DECODERS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
             n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_STD, num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_STD, num_key_value_heads=2, sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_STD, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_STD, num_key_value_heads=2, head_dim=8)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_STD, rotary_pct=0.5,
                 hidden_dropout=0.0, attention_dropout=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=HIDDEN, n_layer=LAYERS, n_head=4,
              hidden_dropout=0.0, attention_dropout=0.0)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=HIDDEN, n_layer=LAYERS,
                    n_head=4, n_positions=32, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0)),
    "falcon_new": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                   num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                   hidden_dropout=0.0, attention_dropout=0.0)),
    "falcon_old": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                   num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
                   parallel_attn=True, hidden_dropout=0.0, attention_dropout=0.0)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_STD, clip_qkv=2.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_STD)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_STD, num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_STD, num_key_value_heads=2, head_dim=8,
               sliding_window=4, query_pre_attn_scalar=8)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_STD, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_STD, num_key_value_heads=2, resid_pdrop=0.0,
             embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_STD, num_key_value_heads=2,
                 hidden_dropout=0.0, attention_dropout=0.0)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, rotary_dim=4,
             n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                rotary_dim=4, n_positions=32, n_ctx=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_STD, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_STD, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(_STD, num_key_value_heads=2, num_experts=4,
              num_experts_per_tok=2)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(_STD, num_key_value_heads=2, use_qk_norm=True)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_STD, num_key_value_heads=2,
                   residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(_STD, num_key_value_heads=2, embedding_multiplier=2.0,
                residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.3)),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(_STD, qk_layernorm=True, hidden_dropout=0.0,
                  attention_dropout=0.0)),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=32,
                resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=HIDDEN, n_heads=4, n_layers=LAYERS, expansion_ratio=2,
            max_seq_len=32)),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(d_model=HIDDEN, num_layers=LAYERS, attention_heads=4, ffn_dim=64,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=32)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_STD, num_key_value_heads=4,
                    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                    first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                    qk_nope_head_dim=4, v_head_dim=8)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(_STD, num_key_value_heads=2, head_dim=8, pad_token_id=0)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(_STD, num_key_value_heads=2)),
}

_NO_POSITIONS_KEY = {"gpt2", "gpt_bigcode", "gptj", "codegen", "bloom", "gpt_neo", "mpt", "xglm"}


def decoder(arch: str, seed: int = 0):
    """A tiny `arch` causal LM wrapped to return logits, with a next-token batch."""
    return build(*DECODERS[arch], seed=seed, positions=arch not in _NO_POSITIONS_KEY)


def build(config_cls: str, model_cls: str, kwargs: dict, seed: int = 0, positions: bool = True):
    """The causal LM `model_cls` from a tiny `config_cls(**kwargs)`, logits only, with a batch."""
    import transformers
    transformers.logging.set_verbosity_error()   # tiny vocab: bos/eos id warnings are noise
    torch.manual_seed(seed)
    extra = {"max_position_embeddings": 32} if positions else {}
    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, use_cache=False,
                                             attn_implementation="eager", **extra, **kwargs)
    model = LogitsOnly(getattr(transformers, model_cls)(cfg)).train()
    inputs, target = token_batch(seed=seed)
    return workload(model, (inputs,), target)


FACTORIES = {arch: functools.partial(decoder, arch) for arch in DECODERS}
