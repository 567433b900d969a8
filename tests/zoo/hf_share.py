"""Hugging Face models whose projections are reached through repeat / copy_ / fused layouts:
DeBERTa-v2 (disentangled attention: relative-position projections of query/key, repeated per
batch row), RWKV (time-mix: token shift, in-place state, per-channel decay), Falcon with its
default config (multi-query fused query_key_value, parallel attention)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, LAYERS, VOCAB, lm_loss, masked_lm_loss, token_batch, workload


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def deberta_v2(seed: int = 0):
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM
    torch.manual_seed(seed)
    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=32, relative_attention=True,
                          position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                          norm_rel_ebd="layer_norm", share_att_key=True, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, position_biased_input=False)
    model = Logits(DebertaV2ForMaskedLM(cfg)).train()
    inputs, target = token_batch(seed=seed)
    return workload(model, (inputs,), target, masked_lm_loss)


def rwkv(seed: int = 0):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  attention_hidden_size=HIDDEN, intermediate_size=64, context_length=32,
                                  use_cache=False)
    model = Logits(transformers.RwkvForCausalLM(cfg)).train()
    inputs, target = token_batch(seed=seed)
    return workload(model, (inputs,), target, lm_loss)


def falcon(seed: int = 0):
    """FalconConfig's defaults (multi_query=True, parallel_attn=True, old architecture), tiny."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                                    attn_implementation="eager")
    model = Logits(transformers.FalconForCausalLM(cfg)).train()
    inputs, target = token_batch(seed=seed)
    return workload(model, (inputs,), target, lm_loss)


FACTORIES = {"deberta_v2": deberta_v2, "rwkv": rwkv, "falcon": falcon}
