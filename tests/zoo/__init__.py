"""The model zoo: architectures nobody wrote the compiler's passes against.

`ZOO = {name: factory}`; each factory(seed=0) returns a workload dict {model, inputs,
target, loss_fn} (as examples/hf.py does), tiny (hidden 32, 2 layers, vocab 96, seq 8,
batch 4), seeded and dropout-free unless the case is about dropout. The comment after each
entry says what awkward part it exercises. `tests/zoo/matrix.py` runs them under plans.
"""
from __future__ import annotations

from tests.zoo import handwritten_attention as _hwa
from tests.zoo import handwritten_coupling as _hwc
from tests.zoo import handwritten_losses as _hwl
from tests.zoo import handwritten_more as _hwm
from tests.zoo import handwritten_moe as _hwmoe
from tests.zoo import handwritten_moe_einsum as _hwmoee
from tests.zoo import handwritten_moe_interleaved as _hwmoei
from tests.zoo import handwritten_lightning as _hwlight
from tests.zoo import handwritten_loops as _hwloop
from tests.zoo import handwritten_scans as _hwscan
from tests.zoo import handwritten_semantics as _hws
from tests.zoo import handwritten_uneven as _hwu
from tests.zoo import ctc as _ctc
from tests.zoo import external as _ext
from tests.zoo import hf_cached as _hfc
from tests.zoo import hf_decoders as _hf
from tests.zoo import hf_share as _hfs
from tests.zoo import meta_llama as _meta
from tests.zoo import hf_other as _hfo
from tests.zoo import hf_recent as _hfr
from tests.zoo import torch_nn as _nn
from tests.zoo import vit as _vit
from tests.zoo import vit16 as _vit16

_D = _hf.FACTORIES

ZOO = {
    # Hugging Face decoders (transformers 5.x, eager attention, built from local configs)
    "gpt2": _D["gpt2"],                  # Conv1D (x @ W with W [in, out]), fused c_attn split, tied head
    "llama": _D["llama"],                # GQA via repeat_kv (expand + reshape), rotary, SwiGLU
    "mistral": _D["mistral"],            # GQA + sliding-window mask
    "qwen2": _D["qwen2"],                # GQA with q/k/v biases
    "qwen3": _D["qwen3"],                # per-head RMSNorm on q and k (norm over head_dim)
    "gpt_neox": _D["gpt_neox"],          # fused QKV laid out per head, partial rotary, parallel residual
    "opt": _D["opt"],                    # padding_idx, offset learned positions, 2-D MLP input
    "bloom": _D["bloom"],                # alibi, batch x heads reshape, baddbmm, fused QKV per head
    "gpt_bigcode": _D["gpt_bigcode"],    # multi-query attention: split_with_sizes of c_attn
    "falcon_new": _D["falcon_new"],      # new_decoder_architecture: grouped fused QKV, parallel attn
    "falcon_old": _D["falcon_old"],      # multi-query fused QKV, parallel attn, mlp_output += attention_output
    "olmo": _D["olmo"],                  # non-parametric LayerNorm, clip_qkv -> clamp_ in place
    "olmo2": _D["olmo2"],                # q/k RMSNorm over the full projection width, post-norms
    "gemma": _D["gemma"],                # scaled embeddings, RMSNorm (1 + w), GeGLU, tied head
    "gemma2": _D["gemma2"],              # logit soft-capping (tanh), sliding window, pre/post norms
    "phi": _D["phi"],                    # parallel attention and MLP, partial rotary, biased head
    "phi3": _D["phi3"],                  # fused qkv_proj and gate_up_proj sliced in forward
    "stablelm": _D["stablelm"],          # partial rotary, LayerNorm with bias, GQA
    "gptj": _D["gptj"],                  # interleaved rotary built with stack/flatten, parallel block
    "codegen": _D["codegen"],            # fused qkv reshaped into mp_num=4 groups, interleaved rotary
    "mixtral": _D["mixtral"],            # MoE: router softmax, top-k, per-expert index/gather/scatter
    "olmoe": _D["olmoe"],                # MoE without top-k renormalisation, q/k norms
    "qwen2_moe": _D["qwen2_moe"],        # MoE with shared expert and sigmoid shared gate
    "cohere": _D["cohere"],              # parallel attn + MLP, LayerNorm without bias, per-head qk norm, logit scale
    "starcoder2": _D["starcoder2"],      # GQA with biases, LayerNorm, plain GELU MLP (c_fc / c_proj)
    "granite": _D["granite"],            # embedding / residual / attention / logits multipliers
    "persimmon": _D["persimmon"],        # fused QKV per head, qk LayerNorm, squared-ReLU, partial rotary
    "gpt_neo": _D["gpt_neo"],            # alternating global / local (windowed) attention, no 1/sqrt(d) scale
    "mpt": _D["mpt"],                    # alibi as a bias table, fused Wqkv chunked, no biases
    "xglm": _D["xglm"],                  # sinusoidal positions (buffer, index_select), scaled embeddings
    "deepseek_v3": _D["deepseek_v3"],    # MLA (low-rank q/kv, split rope/nope), sigmoid-router MoE, dense first layer
    "glm": _D["glm"],                    # fused gate_up chunk, partial interleaved rotary
    "nemotron": _D["nemotron"],          # LayerNorm1P (1 + w), squared-ReLU MLP, partial rotary
    "bert_mlm": _hfo.bert_mlm,           # encoder, masked LM with ignore_index=-100, uneven labels per row
    "t5": _hfo.t5,                       # encoder-decoder, two inputs, relative position bias, cross attn
    # torch.nn modules
    "nn_encoder_seq_first": _nn.transformer_encoder_seq_first,  # batch_first=False: batch is dim 1
    "nn_multihead_attention": _nn.multihead_attention,          # packed in_proj_weight, unflatten
    "nn_decoder": _nn.transformer_decoder,                      # nn.TransformerDecoder, cross attention
    # hand-written layouts
    "hw_nanogpt": _hwa.FACTORIES["hw_nanogpt"],                 # y.transpose(1, 2).contiguous().view(B, T, C)
    "hw_fused_qkv_index": _hwa.FACTORIES["hw_fused_qkv_index"], # qkv[..., :C] slices of a fused projection
    "hw_gqa_repeat_interleave": _hwa.FACTORIES["hw_gqa_repeat_interleave"],  # GQA by repeat_interleave, SDPA
    "hw_param_matmul": _hwa.FACTORIES["hw_param_matmul"],       # x @ W.T with W an nn.Parameter (no Linear)
    "hw_moe_softmax": _hwa.FACTORIES["hw_moe_softmax"],         # softmax router, topk, scatter, dense experts
    "hw_moe_top2": _hwmoe.top2_moe,                             # top-2 router, rows sorted by expert, grouped matmul
    "hw_flat_mlp": _hwa.FACTORIES["hw_flat_mlp"],               # MLP on [B*T, C] tokens (OPT, GPT-2 Conv1D)
    "hw_qk_norm_full_width": _hwa.FACTORIES["hw_qk_norm_full_width"],  # RMSNorm over the sharded q/k width (OLMo2)
    "hw_einsum": _hwm.FACTORIES["hw_einsum"],                   # einsum projections against [h, d, C] params
    "hw_shared_block": _hwm.FACTORIES["hw_shared_block"],       # one block reused 4x: weights shared across stages
    "llama_padded": _hwm.FACTORIES["llama_padded"],             # HF LLaMA + attention_mask input, -100 on pads
    # hand-written training semantics
    "hw_frozen": _hws.frozen_params,          # requires_grad=False embedding and first block
    "hw_inplace_skip": _hws.inplace_skip,     # h += a on the block input (received boundary value)
    "hw_sum_loss": _hws.sum_reduction,        # cross_entropy(reduction="sum")
    "hw_label_smoothing": _hws.label_smoothing,  # label_smoothing=0.1 (sum over the vocab dim)
    "hw_two_dropouts": _hws.two_dropouts,     # DROPOUT CASE: 4 same-shaped p=0.5 dropouts in series
    "hw_tp_dropout": _hws.tp_dropout,         # DROPOUT CASE: p=0.8 dropout on column-parallel features
    "hw_ce_class_dim1": _hwl.FACTORIES["hw_ce_class_dim1"],           # cross_entropy on [B, V, T] (class dim 1)
    "hw_weighted_tokens": _hwl.FACTORIES["hw_weighted_tokens"],       # (ce * w).sum() / w.sum(), uneven weights
    "hw_nonseparable_loss": _hwl.FACTORIES["hw_nonseparable_loss"],   # mean(ce)**2: PlanError expected when m>1 or dp>1
    "hw_batchnorm": _hws.batchnorm,           # BatchNorm1d train mode: PlanError expected when m>1 or dp>1
    # the last mile (issue 21): what a new user's model brings along
    "llama_cache": _hfc.FACTORIES["llama_cache"],   # use_cache=True, whole ModelOutput returned (cache cat of [])
    "qwen2_cache": _hfc.FACTORIES["qwen2_cache"],   # same, with q/k/v biases
    "conv_ctc": _ctc.FACTORIES["conv_ctc"],         # CTC loss (untraceable): computed eagerly, per-row mean
    "wav2vec2_ctc": _ctc.FACTORIES["wav2vec2_ctc"], # HF Wav2Vec2ForCTC: conv encoder, weight-norm pos conv, CTC
    "vit17": _vit.FACTORIES["vit17"],               # CLS + 16 patches = 17 tokens: sp pads the sequence shards
    "hf_vit17": _vit.FACTORIES["hf_vit17"],         # HF ViTForImageClassification, 17 tokens
    "vit16_mean": _vit16.FACTORIES["vit16_mean"],   # 16 patch tokens born in forward, whole position table, mean pool
    "vit16_cls": _vit16.FACTORIES["vit16_cls"],     # CLS + 15 patches born in forward (cat), whole table, CLS pool
    "hf_vit16": _vit16.FACTORIES["hf_vit16"],       # HF ViTForImageClassification on 12x20 images: 15 + CLS = 16
    "hf_deit16": _vit16.FACTORIES["hf_deit16"],     # HF DeiT: 14 patches + CLS + distillation token = 16
    "hf_dinov2_16": _vit16.FACTORIES["hf_dinov2_16"],  # HF Dinov2: position table interpolated in forward, 16 tokens
    "gpt_seq7": _vit.FACTORIES["gpt_seq7"],         # 7 tokens: sp pads the vocab-parallel embedding's shards
    "meta_llama": _meta.FACTORIES["meta_llama"],    # Meta's reference LLaMA: view_as_complex rotary, expand GQA
    "deberta_v2": _hfs.FACTORIES["deberta_v2"],     # disentangled attention: repeat of relative-position q/k
    "rwkv": _hfs.FACTORIES["rwkv"],                 # time-mix token shift, per-channel decay, WKV recurrence
    "falcon": _hfs.FACTORIES["falcon"],             # FalconConfig defaults: multi-query fused query_key_value
    # rows of the batch coupled, buffers written in forward, custom autograd (issue 21)
    "hw_moe_capacity": _hwc.moe_capacity,     # top-2 MoE, capacity by a cumsum over all tokens: PlanError when m>1 or dp>1
    "hw_infonce": _hwc.infonce,               # in-batch B x B contrastive loss: PlanError when m>1 or dp>1
    "hw_step_counter": _hwc.step_counter,     # step-counter buffer read after its update: exact, once per step
    "hw_running_buffer": _hwc.running_buffer, # running mean of activations in a buffer: PlanError when m>1 or dp>1
    "hw_ste": _hwc.ste,                       # custom autograd.Function (straight-through round): PlanError always
    # uneven tp shards (issue 21 item 5): padded by whole heads / features under tp=2
    "hw_three_heads": _hwu.FACTORIES["hw_three_heads"],   # 3 heads: a zero head pads rank 1
    "hw_odd_ffn": _hwu.FACTORIES["hw_odd_ffn"],           # MLP width 37 through a sigmoid (0.5 on padding)
    # issue 40: expert weights read through slices, recent HF MoE
    "hw_moe_interleaved": _hwmoei.interleaved_moe,  # gate/up interleaved in one [E, C, 2F] weight: w[..., ::2]
    "hw_moe_einsum": _hwmoee.FACTORIES["hw_moe_einsum"],            # dense experts as einsum, experts on dim 1
    "hw_moe_einsum_soft": _hwmoee.FACTORIES["hw_moe_einsum_soft"],  # Soft MoE slots by stacked-expert einsums
    # issue 40 item 7: recurrences written as scans over time (cp hands each block its carry)
    "hw_linear_attention": _hwscan.FACTORIES["hw_linear_attention"],  # cumsum of phi(k) v^T outer products
    "hw_min_gru": _hwscan.FACTORIES["hw_min_gru"],                    # log-space scan: cumsum + logcumsumexp
    "hw_decay_cumprod": _hwscan.FACTORIES["hw_decay_cumprod"],        # decay by cumprod, A * cumsum(v / A)
    "hw_gated_loop": _hwloop.FACTORIES["hw_gated_loop"],              # Python loop: h = a*h + (1-a)*v, stacked
    "hw_two_state_loop": _hwloop.FACTORIES["hw_two_state_loop"],      # Python loop: num/den states, out[:, t] = ..
    "hw_lightning": _hwlight.FACTORIES["hw_lightning"],               # MiniMax lightning attention, one block: decay tables sliced [:T, :T]
    "hw_lightning_blocks": _hwlight.FACTORIES["hw_lightning_blocks"], # lightning attention, blocks of 4: a loop over blocks carrying K^T V
    "hw_retention": _hwlight.FACTORIES["hw_retention"],               # RetNet retention: decay gamma^(i-j) from arange(T), no softmax
    # issue 40: recent Hugging Face architectures (tests/zoo/hf_recent.py says what each brings)
    **_hfr.FACTORIES,
    # issue 40 item 6: other projects' models used as is from their PyPI packages (the `zoo`
    # extra); tests/zoo/external.py says what each brings, test_zoo_external.py skips when absent
    **_ext.FACTORIES,
}

# Cases judged by distribution instead of exact parity (random masks differ from one process):
# name -> relative tolerance on the losses, set between the sampling noise and the change a
# repeated mask would cause (see each factory's docstring).
DROPOUT_CASES = {"hw_two_dropouts": 0.5, "hw_tp_dropout": 1.0}


# Cells that fail for a cause outside the case the arch was added for, with that cause. The
# matrix skips them: a rank that fails mid-step leaves its peer waiting, and every later
# cell of the job then fails with it.
KNOWN_BROKEN: dict = {}


def expected_planerror(arch: str, plan) -> bool:
    """Cells where exact equality is impossible and the compiler must refuse (issue 10 item 1)."""
    splits_batch = plan.microbatches > 1 or plan.dp > 1
    if arch in ("hw_ste", "phimoe"):   # a custom autograd.Function (phimoe: its router's sparsemixer)
        return True
    if arch in ("st_moe", "sgmoe"):     # F.one_hot(idx, max(idx.max() + 1, capacity)): sizes read from the data
        return True
    return arch in ("hw_batchnorm", "hw_nonseparable_loss", "hw_moe_capacity", "hw_infonce",
                    "hw_running_buffer") and splits_batch
