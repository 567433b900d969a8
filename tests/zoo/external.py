"""Models from other public projects, used as is through their PyPI packages (issue 40 item 6).

Nothing of theirs is copied here: each factory builds a tiny configuration through the
package's public classes and constructor arguments, with no patching of their code. The
packages are the `zoo` extra in pyproject.toml; a factory whose package is missing raises
`MissingPackage`, which tests/test_zoo_external.py turns into a one-line skip.

Versions tested (2026-12-06): x-transformers 2.31.10, PaLM-pytorch 0.2.2, st-moe-pytorch
0.1.8, mixture-of-experts 0.2.3, soft-moe-pytorch 0.1.9 (all MIT, all by lucidrains on GitHub).

The three MoE packages ship an MoE layer, not a language model: their factories wrap the
package's own block in the smallest LM shell (embedding, the block twice with a residual,
norm, head) and add the package's own auxiliary loss to the LM loss.
"""
from __future__ import annotations

import importlib

import torch

from tests.zoo.common import HIDDEN, LAYERS, SEQ, VOCAB, lm_loss, token_batch, workload


class MissingPackage(ImportError):
    """The package a factory needs is not installed (pip install -e '.[zoo]')."""


# zoo name -> (importable module, PyPI distribution, license, upstream repository)
PACKAGES = {
    "xt_decoder": ("x_transformers", "x-transformers", "MIT", "github.com/lucidrains/x-transformers"),
    "xt_autoregressive": ("x_transformers", "x-transformers", "MIT", "github.com/lucidrains/x-transformers"),
    "palm": ("palm_pytorch", "PaLM-pytorch", "MIT", "github.com/lucidrains/PaLM-pytorch"),
    "st_moe": ("st_moe_pytorch", "st-moe-pytorch", "MIT", "github.com/lucidrains/st-moe-pytorch"),
    "sgmoe": ("mixture_of_experts", "mixture-of-experts", "MIT", "github.com/lucidrains/mixture-of-experts"),
    "soft_moe": ("soft_moe_pytorch", "soft-moe-pytorch", "MIT", "github.com/lucidrains/soft-moe-pytorch"),
}


def _package(arch: str):
    module, dist, _, _ = PACKAGES[arch]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackage(f"{arch} needs the PyPI package {dist} (pip install -e '.[zoo]')") from exc


def package_version(arch: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(PACKAGES[arch][1])
    except PackageNotFoundError:
        return None


def xt_decoder(seed: int = 0):
    """x-transformers' TransformerWrapper over a Decoder: rotary, einsum attention with its own
    causal mask, pre-norm; it returns logits."""
    xt = _package("xt_decoder")
    torch.manual_seed(seed)
    model = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=2 * SEQ,
                                  attn_layers=xt.Decoder(dim=HIDDEN, depth=LAYERS, heads=4, rotary_pos_emb=True))
    inputs, target = token_batch(seed=seed)
    return workload(model.train(), (inputs,), target)


def _own_loss(loss, target):
    return loss   # the package computed the loss inside forward


def xt_autoregressive(seed: int = 0):
    """x-transformers' AutoregressiveWrapper: forward takes the whole token row, shifts them itself and
    returns its own cross-entropy (the target argument is unused)."""
    xt = _package("xt_autoregressive")
    torch.manual_seed(seed)
    net = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=2 * SEQ,
                                attn_layers=xt.Decoder(dim=HIDDEN, depth=LAYERS, heads=4, rotary_pos_emb=True))
    model = xt.AutoregressiveWrapper(net).train()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)   # SEQ - 1 positions after its shift
    # a scalar is all it returns, so no output rows show which input dim is the batch: declared
    return {**workload(model, (tokens,), tokens[:, 1:], _own_loss), "batch_dims": (0, 0)}


def palm(seed: int = 0):
    """PaLM-pytorch: parallel attention + SwiGLU block from one fused projection, multi-query
    attention, rotary, causal mask and rotary tables cached in buffers on first use, tied-free head."""
    pp = _package("palm")
    torch.manual_seed(seed)
    model = pp.PaLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=8, heads=4, ff_mult=2)
    inputs, target = token_batch(seed=seed)
    return workload(model.train(), (inputs,), target)


class _MoELM(torch.nn.Module):
    """The smallest LM around a package's MoE block: it returns (logits, summed aux loss), or
    the logits alone when the blocks return only their output (aux=False)."""

    def __init__(self, blocks, aux: bool = True):
        super().__init__()
        self.aux = aux
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(blocks)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h, aux = self.embed(input_ids), 0.0
        for block in self.blocks:
            out = block(h)
            if self.aux:
                h, aux = h + out[0], aux + out[1]
            else:
                h = h + out
        logits = self.head(self.norm(h))
        return (logits, aux) if self.aux else logits


def _lm_plus_aux(out, target):
    return lm_loss(out[0], target) + out[1]


def st_moe(seed: int = 0):
    """st-moe-pytorch's SparseMoEBlock (ST-MoE): softmax top-2 router, per-sequence expert
    capacity by a cumsum along the sequence, dispatch/combine einsums, per-expert GEGLU Experts,
    balance + router z-loss. threshold_train=1e-9 routes every second choice (the default draws
    a uniform sample per token); is_distributed=False keeps its own all_gather out."""
    sm = _package("st_moe")
    torch.manual_seed(seed)
    blocks = [sm.SparseMoEBlock(sm.MoE(dim=HIDDEN, num_experts=4, gating_top_n=2, expert_hidden_mult=2,
                                       threshold_train=1e-9, capacity_factor_train=2.0, is_distributed=False),
                                add_ff_after=True) for _ in range(LAYERS)]
    inputs, target = token_batch(seed=seed)
    # without attention every position is computed alone: the sequence dim would split as well
    return {**workload(_MoELM(blocks).train(), (inputs,), target, _lm_plus_aux), "batch_dims": (0, 0)}


def sgmoe(seed: int = 0):
    """mixture-of-experts (sparsely-gated MoE): top-2 gating with capacity by a cumsum along the
    sequence, expert weights stacked as [E, C, H] and applied by einsum, importance loss.
    second_policy_train='all' always routes the second choice (the default draws a sample)."""
    moe = _package("sgmoe")
    torch.manual_seed(seed)
    blocks = [moe.MoE(dim=HIDDEN, num_experts=4, hidden_dim=2 * HIDDEN, second_policy_train="all",
                      capacity_factor_train=2.0) for _ in range(LAYERS)]
    inputs, target = token_batch(seed=seed)
    return {**workload(_MoELM(blocks).train(), (inputs,), target, _lm_plus_aux), "batch_dims": (0, 0)}


def soft_moe(seed: int = 0):
    """soft-moe-pytorch's SoftMoE (Soft MoE): every slot is a softmax-weighted mix of all
    tokens of its sequence, experts are a ModuleList applied per expert, outputs mixed back by a
    second softmax; no discrete routing. It mixes positions (not causal): cp cannot split it.
    is_distributed=False keeps its own all_gather out; no CPU offload of unused experts."""
    sm = _package("soft_moe")
    torch.manual_seed(seed)
    blocks = [sm.SoftMoE(dim=HIDDEN, seq_len=SEQ, num_experts=4, expert_mult=2, is_distributed=False,
                         offload_unused_experts_to_cpu=False) for _ in range(LAYERS)]
    inputs, target = token_batch(seed=seed)
    return workload(_MoELM(blocks, aux=False).train(), (inputs,), target)


FACTORIES = {"xt_decoder": xt_decoder, "xt_autoregressive": xt_autoregressive, "palm": palm,
             "st_moe": st_moe, "sgmoe": sgmoe, "soft_moe": soft_moe}
MOE = ["st_moe", "sgmoe", "soft_moe"]


def missing_reason(arch: str) -> str | None:
    """One line saying which package `arch` lacks, or None when it can be built (or is not external)."""
    if arch not in PACKAGES:
        return None
    try:
        _package(arch)
    except MissingPackage as exc:
        return str(exc)
    return None
