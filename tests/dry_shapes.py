"""Scaled-down versions of bench/dry_run_scale.py's Llama-405B- and DeepSeek-V3-shaped
models for the dry-run memory tests: long sequences (attention's s x s matters), GQA,
top-k routed experts. SPEC factories on the meta device."""
from __future__ import annotations

import torch

from tests.bench_scripts import bench_on_path


def _models():
    with bench_on_path():
        import dry_run_scale
        return dry_run_scale


def llama(batch: int = 8, seq: int = 1024, layers: int = 8, dim: int = 256, heads: int = 8, kv: int = 2,
          ffn: int = 704, vocab: int = 1024):
    m = _models()
    with torch.device("meta"):
        model = m.Decoder(vocab, dim, layers, heads, kv, lambda: m.SwiGLU(dim, ffn))
    return m._workload(model, vocab, batch, seq)


def moe(batch: int = 4, seq: int = 1024, layers: int = 4, dim: int = 128, heads: int = 8, experts: int = 8,
        top_k: int = 2, ffn: int = 64, vocab: int = 512):
    m = _models()
    with torch.device("meta"):
        model = m.Decoder(vocab, dim, layers, heads, heads, lambda: m.RoutedExperts(dim, experts, top_k, ffn))
    return m._workload(model, vocab, batch, seq)
