"""The decoder the shape flags describe, as a graph: where their saved activations come from.

The planner has one rule for what a layer keeps for backward: planner/saved_bytes.py run on a
traced graph (the SPEC path, and `program_memory` for a compiled program, both checked
against autograd in tests/test_memory_model.py). The shape flags (--kv-heads, --ffn,
--mlp swiglu, --no-tied) describe a model rather than give one, so `flags_activations` builds
that model here, written as the Llama-family code threefold is given is written (RMSNorm
computed in fp32, rotary embeddings on q and k, K and V repeated to every query head
(grouped-query attention), scaled_dot_product_attention with a causal mask, a SwiGLU MLP,
an untied or tied output projection), traces two layers of it on the meta device at the
flags' width and sequence length, and reads the activation figures off it with the SPEC
path's own code (spec_cost.model_cost_from_program). The two descriptions of one model then
share one count of saved bytes, not two formulas.

Everything here is plain PyTorch and takes no weights: the meta device allocates nothing.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATION_FIELDS = ("act_split", "act_repl", "act_input", "act_selective_split", "act_selective_repl",
                     "post_act", "post_act_split")
_LAYERS = 2          # block 0 is measured; block 1 tells the SPEC path where a block ends
_EPS = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _EPS)
        return self.weight * x.to(dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(heads * self.dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = self.heads // self.kv_heads     # each K/V head serves `group` query heads

        def repeat(t):
            return t[:, :, None].expand(b, self.kv_heads, group, s, self.dim).reshape(b, self.heads, s, self.dim)
        y = F.scaled_dot_product_attention(q, repeat(k), repeat(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().reshape(b, s, -1).contiguous())


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.library.custom_op("threefold_reference::grouped_mm_fallback", mutates_args=())
def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert [S, in] times each expert's weight [E, in, out]: rows up to
    offs[e] (exclusive of the previous offset) use expert e (a grouped matmul)."""
    out = input.new_zeros(input.shape[0], weight.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = input[start:end] @ weight[e]
        start = end
    return out


@grouped_mm.register_fake
def _(input, weight, offs):
    return input.new_empty(input.shape[0], weight.shape[-1])


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad_x = grouped_mm(grad, w.transpose(-2, -1).contiguous(), offs)
    grad_w = torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        grad_w[e] = x[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return grad_x, grad_w, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


class Experts(nn.Module):
    """E SwiGLU experts: gate and up side by side [E, 2f, h], down [E, h, f]."""

    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, rows, offs):
        gate, up = grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs)


class MoE(nn.Module):
    """A dropless top-k mixture of SwiGLU experts: softmax router, the k weights renormalised,
    each token's k rows sorted by expert, one grouped matmul per projection, the rows scaled
    by their weights, put back in token order and summed."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.experts_count, self.top_k = experts, top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, ffn, experts)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen = torch.softmax(self.gate(flat).float(), dim=-1).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype).reshape(-1)
        by_expert, order = chosen.reshape(-1).sort()
        rows = flat[order // self.top_k]
        counts = torch.histc(by_expert.float(), bins=self.experts_count, min=0, max=self.experts_count - 1)
        out = self.experts(rows, counts.cumsum(0).to(torch.int32)) * weights[order].unsqueeze(-1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return out[back].view(-1, self.top_k, shape[-1]).sum(1).reshape(shape)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, experts: int = 0, top_k: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MoE(hidden, ffn, experts, top_k) if experts else SwiGLU(hidden, ffn)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, tied: bool,
                 experts: int = 0, top_k: int = 0):
        super().__init__()
        self.dim = hidden // heads
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn, experts, top_k) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, self.dim, 2).float() / self.dim),
                             persistent=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        pos = torch.arange(ids.shape[1], device=ids.device).float()
        angles = torch.outer(pos, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype)[None, None], angles.sin().to(x.dtype)[None, None]
        for block in self.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


@functools.lru_cache(maxsize=64)
def flags_activations(hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
                      tied: bool, experts: int = 0, top_k: int = 0) -> dict:
    """The activation figures (ModelCost's ACTIVATION_FIELDS, bytes per token in 16-bit) of
    the decoder these flags describe (`experts`: each MLP a top-`top_k` mixture of that many
    SwiGLU experts of width `ffn`), from its traced graph by the SPEC path's rules."""
    # lazy: start-up: threefold.compiler.trace loads 13 more modules only when this runs
    from threefold.compiler.trace import trace
    # lazy: start-up: threefold.planner.spec_cost loads 17 more modules only when this runs
    from threefold.planner.spec_cost import model_cost_from_program
    with torch.device("meta"):
        model = Decoder(_LAYERS, hidden, heads, kv_heads, ffn, vocab, tied, experts, top_k)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    cost = model_cost_from_program(trace(model, (ids,), ids, _loss), (ids,), "flags")
    return {k: getattr(cost, k) for k in ACTIVATION_FIELDS}
