"""examples/gpt.py: SPEC factories around the small nanoGPT-style GPT.

The model itself lives in threefold/models/gpt.py (plain PyTorch, nothing threefold-specific:
learned positions, one fused QKV linear split into q, k, v, causal masked softmax, GELU MLP,
pre-norm blocks, LM head tied to the token embedding), because the main job
(`threefold train`) trains it too. Copy that file to start your own model.

SPECs: `examples/gpt.py:workload`, `examples/gpt.py:gpt_medium_meta`, `examples/gpt.py:paper_1t`.
"""
from __future__ import annotations

import torch

from threefold.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, lm_loss  # noqa: F401


def workload(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, vocab_size: int = 96,
             seq: int = 16, batch: int = 8, device: str = "cpu", seed: int = 0):
    """SPEC factory: `examples/gpt.py:workload`. A tiny GPT with a random batch."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab_size, block_size=max(seq, 16), n_layer=n_layer,
                    n_head=n_head, n_embd=n_embd)
    with torch.device(device):
        model = GPT(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab_size, (batch, seq + 1), generator=g).to(device)
    return {"model": model, "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}


def gpt_medium_meta(n_layer: int = 24):
    """GPT-2 medium-sized shape on the meta device (no memory), for cost and balance studies."""
    return workload(n_layer=n_layer, n_embd=1024, n_head=16, vocab_size=50304, seq=1024,
                    batch=1, device="meta")


def paper_1t(n_layer: int = 128, seq: int = 2048, batch: int = 1):
    """The 1T-parameter GPT of Narayanan et al. (SC'21), Table 1, on the meta device.

    128 layers, hidden 25600, 160 heads, vocab 51200, sequence 2048; one microbatch of
    `batch` sequences. Nothing is allocated: it exists to measure the compiler at scale.
    """
    return workload(n_layer=n_layer, n_embd=25600, n_head=160, vocab_size=51200, seq=seq,
                    batch=batch, device="meta")
