"""Hugging Face GPT-2 and LLaMA built from a config (no weights are downloaded).

SPECs: `examples/hf.py:gpt2` and `examples/hf.py:llama`. Tiny by default; every size is a
keyword argument. use_cache=False so the forward is a pure function of the inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class LogitsOnly(torch.nn.Module):
    """Returns the logits tensor instead of a ModelOutput, so the loss can follow."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def _batch(vocab: int, batch: int, seq: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def gpt2(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 128,
         seq: int = 16, batch: int = 4, device: str = "cpu", seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                     n_positions=max(seq, 16), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, attn_implementation="eager")
    with torch.device(device):
        model = LogitsOnly(GPT2LMHeadModel(cfg))
    inputs, target = _batch(vocab_size, batch, seq, seed, device)
    return {"model": model, "inputs": (inputs,), "target": target, "loss_fn": lm_loss}


def llama(n_layer: int = 2, hidden: int = 64, n_head: int = 4, n_kv_head: int = 2,
          intermediate: int = 128, vocab_size: int = 128, seq: int = 16, batch: int = 4,
          device: str = "cpu", seed: int = 0, tie: bool = False, attn: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                      num_key_value_heads=n_kv_head, intermediate_size=intermediate,
                      vocab_size=vocab_size, max_position_embeddings=max(seq, 16),
                      tie_word_embeddings=tie, use_cache=False, attn_implementation=attn)
    with torch.device(device):
        model = LogitsOnly(LlamaForCausalLM(cfg))
    inputs, target = _batch(vocab_size, batch, seq, seed, device)
    return {"model": model, "inputs": (inputs,), "target": target, "loss_fn": lm_loss}


# Tiny configurations of other decoder architectures, for robustness tests: each exercises
# something the two above do not (OPT: padding_idx, offset learned positions, 2-D MLP
# input; GPT-NeoX: fused QKV laid out per head, partial rotary; Gemma: scaled embeddings,
# RMSNorm with 1 + weight, GeGLU; Mistral/Qwen2: GQA with biases or sliding-window config;
# GPT-J: interleaved rotary built with stack; Phi: parallel attention and MLP).
_TINY = {
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4)),
}


def causal_lm(arch: str = "opt", vocab_size: int = 128, seq: int = 8, batch: int = 4, seed: int = 0):
    """SPEC factory `examples/hf.py:causal_lm(arch="opt")`: a tiny model of that architecture."""
    import transformers
    if arch not in _TINY:
        raise ValueError(f"unknown arch {arch!r}: choose one of {', '.join(sorted(_TINY))}")
    config_cls, model_cls, kwargs = _TINY[arch]
    torch.manual_seed(seed)
    positions = {"n_positions": 32} if arch == "gptj" else {"max_position_embeddings": 32}
    cfg = getattr(transformers, config_cls)(vocab_size=vocab_size, use_cache=False,
                                             attn_implementation="eager", **positions, **kwargs)
    model = LogitsOnly(getattr(transformers, model_cls)(cfg))
    inputs, target = _batch(vocab_size, batch, seq, seed, "cpu")
    return {"model": model, "inputs": (inputs,), "target": target, "loss_fn": lm_loss}
