"""Hugging Face decoders as a new user builds them: use_cache=True (most configs' default),
the whole ModelOutput returned (logits and the key/value cache), the loss reading .logits."""
from __future__ import annotations

import torch

from tests.zoo.common import HIDDEN, LAYERS, VOCAB, lm_loss, token_batch, workload


def logits_loss(out, target):
    return lm_loss(out.logits, target)


def _cached(config_name: str, model_name: str, seed: int, **extra):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=True,
        attn_implementation="eager", **extra)
    model = getattr(transformers, model_name)(cfg).train()
    inputs, target = token_batch(seed=seed)
    return workload(model, (inputs,), target, logits_loss)


def llama_cache(seed: int = 0):
    return _cached("LlamaConfig", "LlamaForCausalLM", seed)


def qwen2_cache(seed: int = 0):
    return _cached("Qwen2Config", "Qwen2ForCausalLM", seed)


FACTORIES = {"llama_cache": llama_cache, "qwen2_cache": qwen2_cache}
