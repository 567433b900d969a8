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
          device: str = "cpu", seed: int = 0, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                      num_key_value_heads=n_kv_head, intermediate_size=intermediate,
                      vocab_size=vocab_size, max_position_embeddings=max(seq, 16),
                      tie_word_embeddings=tie, use_cache=False, attn_implementation="eager")
    with torch.device(device):
        model = LogitsOnly(LlamaForCausalLM(cfg))
    inputs, target = _batch(vocab_size, batch, seq, seed, device)
    return {"model": model, "inputs": (inputs,), "target": target, "loss_fn": lm_loss}
