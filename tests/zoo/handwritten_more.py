"""More hand-written layouts: einsum projections, one block reused at every depth (weights
shared across pipeline stages), and a padded batch with an attention mask input."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, LAYERS, SEQ, VOCAB, masked_lm_loss, token_batch, workload
from tests.zoo.handwritten_attention import HEADS, MLP, Block, NanoGPTAttention, TinyDecoder, causal_attention


class EinsumAttention(nn.Module):
    """Projections as einsum against [heads, head_dim, C] parameters (no nn.Linear, no view)."""

    def __init__(self):
        super().__init__()
        hd = HIDDEN // HEADS
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(HEADS, hd, HIDDEN) * 0.05) for _ in range(3))
        self.wo = nn.Parameter(torch.randn(HIDDEN, HEADS, hd) * 0.05)

    def forward(self, x):                                      # [B, T, C]
        q = torch.einsum("btc,hdc->bhtd", x, self.wq)
        k = torch.einsum("btc,hdc->bhtd", x, self.wk)
        v = torch.einsum("btc,hdc->bhtd", x, self.wv)
        y = causal_attention(q, k, v)                          # [B, h, T, d]
        return torch.einsum("bhtd,chd->btc", y, self.wo)


class EinsumMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(HIDDEN, 4 * HIDDEN) * 0.05)
        self.w2 = nn.Parameter(torch.randn(4 * HIDDEN, HIDDEN) * 0.05)

    def forward(self, x):
        return torch.einsum("btf,fc->btc", F.gelu(torch.einsum("btc,cf->btf", x, self.w1)), self.w2)


def einsum_projections(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(TinyDecoder(EinsumAttention, EinsumMLP).train(), (inputs,), target)


class SharedBlockLM(nn.Module):
    """ALBERT/Universal-Transformer style: one block applied 4 times, so with pp=2 the same
    parameters live on both stages and their gradients must be summed across stages."""

    def __init__(self, repeats: int = 4):
        super().__init__()
        self.repeats = repeats
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.block = Block(NanoGPTAttention, MLP)
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for _ in range(self.repeats):
            x = self.block(x)
        return self.lm_head(self.ln_f(x))


def shared_block(seed: int = 0):
    torch.manual_seed(seed)
    inputs, target = token_batch(seed=seed)
    return workload(SharedBlockLM().train(), (inputs,), target)


class PaddedLlama(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def llama_padded(seed: int = 0):
    """HF LLaMA with a second input, a right-padded attention mask (rows of 8, 6, 3 and 5 real
    tokens), and -100 targets on the pads: the mask and the labels split with the batch."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
                      attn_implementation="eager", pad_token_id=0)
    model = PaddedLlama(LlamaForCausalLM(cfg)).train()
    inputs, target = token_batch(seed=seed)
    mask = torch.zeros_like(inputs)
    for row, n in enumerate((8, 6, 3, 5)[:inputs.shape[0]]):
        mask[row, :n] = 1
    inputs = inputs.masked_fill(mask == 0, 0)
    target = target.masked_fill(mask == 0, -100)
    return workload(model, (inputs, mask), target, masked_lm_loss)


FACTORIES = {
    "hw_einsum": einsum_projections,
    "hw_shared_block": shared_block,
    "llama_padded": llama_padded,
}
