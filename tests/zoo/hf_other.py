"""Hugging Face models that are not plain causal LMs: BERT masked LM and T5 encoder-decoder."""
from __future__ import annotations

import torch

from tests.zoo.common import BATCH, HIDDEN, LAYERS, VOCAB, lm_loss, masked_lm_loss, token_batch, workload


class MaskedLMLogits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def bert_mlm(seed: int = 0):
    """BERT masked LM; labels are -100 except 1, 2, 4 and 7 positions in rows 0..3, so a
    mean of per-microbatch (or per-dp-rank) means is not the global masked mean."""
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager")
    model = MaskedLMLogits(BertForMaskedLM(cfg)).train()
    inputs, tokens = token_batch(seed=seed)
    labels = torch.full_like(tokens, -100)
    for row, count in enumerate((1, 2, 4, 7)[:tokens.shape[0]]):   # the batch's rows (2 in bench/cp_zoo_survey.py)
        labels[row, :count] = tokens[row, :count]
    return workload(model, (inputs,), labels, masked_lm_loss)


class Seq2SeqLogits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits


def t5(seed: int = 0):
    """T5 encoder-decoder: two token inputs, relative position bias, cross attention."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=LAYERS,
                   num_decoder_layers=LAYERS, num_heads=4, dropout_rate=0.0, use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
    model = Seq2SeqLogits(T5ForConditionalGeneration(cfg)).train()
    src, _ = token_batch(seed=seed + 7)
    dec_in, target = token_batch(seed=seed)
    return workload(model, (src, dec_in), target, lm_loss)


FACTORIES = {"bert_mlm": bert_mlm, "t5": t5}
