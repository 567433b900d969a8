"""The embedded GPT (models/gpt.py) as a Hugging Face GPT-2: the same function, other names.

Our GPT computes exactly what `transformers.GPT2LMHeadModel` computes when its config says
so: pre-norm blocks with LayerNorm (eps 1e-5), a fused q/k/v projection, attention scaled by
1/sqrt(head size) under a causal mask, an MLP of 4h with exact GELU (`activation_function=
"gelu"`; GPT-2's own default is the tanh approximation, "gelu_new"), learned positions and
an LM head tied to the token embedding. The names differ by GPT-2's `transformer.` prefix,
and GPT-2's projections are `Conv1D` modules, whose weight is the transpose of a Linear's.
`threefold export` writes a checkpoint of the embedded model this way (config.json and
model.safetensors), so `from_pretrained` loads it and gives the same logits (tested).
"""
from __future__ import annotations

import torch

from threefold.errors import PlanError
from threefold.models.gpt import GPTConfig

# what GPT-2's config must say for its model to compute our GPT's function
_SAME_FUNCTION = {"activation_function": "gelu", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
                  "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True}


def gpt2_config(cfg: GPTConfig):
    """The transformers GPT2Config of a GPT of `cfg` (a PlanError if none computes it)."""
    from transformers import GPT2Config   # lazy: transformers loads only for Hugging Face models
    if not cfg.bias:
        raise PlanError("the GPT was built with bias=False, which GPT-2 has no setting for: export it "
                        "without a Hugging Face config (threefold export writes its own names then)")
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
                      embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, bos_token_id=None,
                      eos_token_id=None, use_cache=False, **_SAME_FUNCTION)


def check_gpt2_config(config, cfg: GPTConfig) -> None:
    """A PlanError naming the first setting of a user's GPT-2 config that would make its
    model compute something else than the GPT of `cfg`."""
    if getattr(config, "model_type", None) != "gpt2":
        raise PlanError(f"--hf-config is a {getattr(config, 'model_type', '?')} config, but the checkpoint holds "
                        "threefold's embedded GPT: give a GPT-2 config, or leave --hf-config out (one is written)")
    want = gpt2_config(cfg)
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", *_SAME_FUNCTION):
        if getattr(config, key, None) != getattr(want, key):
            raise PlanError(f"--hf-config says {key}={getattr(config, key, None)!r}, but the checkpoint's GPT has "
                            f"{key}={getattr(want, key)!r}: fix the config, or leave --hf-config out (one is written)")


def gpt2_state(full: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Our GPT's tensors under GPT2LMHeadModel's keys for `config` (Conv1D weights
    transposed); the tied LM head is the token embedding."""
    from transformers import GPT2LMHeadModel   # lazy: transformers loads only for Hugging Face models
    from transformers.pytorch_utils import Conv1D   # lazy: transformers loads only for Hugging Face models
    with torch.device("meta"):
        hf = GPT2LMHeadModel(config)
    conv = {f"{name}.weight" for name, m in hf.named_modules() if isinstance(m, Conv1D)}
    target_state = hf.state_dict(keep_vars=True)
    table = hf.get_input_embeddings().weight          # the LM head's weight too (tied)
    embedding = next(k for k, v in target_state.items() if v is table)
    out = {}
    for key, target in target_state.items():
        ours = (embedding if target is table else key).removeprefix("transformer.")
        if ours not in full:
            raise PlanError(f"the checkpoint has no tensor {ours} for GPT-2's {key}: it is not of threefold's "
                            "embedded GPT")
        t = full[ours].t() if key in conv else full[ours]
        if list(t.shape) != list(target.shape):
            raise PlanError(f"checkpoint tensor {ours} has shape {list(full[ours].shape)}, GPT-2's {key} needs "
                            f"{list(target.shape)}: the config is of another size")
        out[key] = t
    return out
