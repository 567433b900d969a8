"""Tiny Mixtral trained with its router's load-balancing loss (output_router_logits=True):
loss = cross-entropy + router_aux_loss_coef x aux, where aux = E x sum_e f_e x P_e, f_e the
fraction of (token, slot) picks that chose expert e and P_e the mean router probability of
e, both means over every token of the batch."""
from __future__ import annotations

import torch

from tests.zoo.common import VOCAB, lm_loss, token_batch, workload
from tests.zoo.hf_decoders import DECODERS


class LogitsAndAux(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=False)
        return out.logits, out.aux_loss


def mixtral_aux(seed: int = 0, coef: float = 0.02):
    import transformers
    transformers.logging.set_verbosity_error()
    _, _, kwargs = DECODERS["mixtral"]
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, use_cache=False, attn_implementation="eager",
                                     max_position_embeddings=32, output_router_logits=True,
                                     router_aux_loss_coef=coef, **kwargs)
    model = LogitsAndAux(transformers.MixtralForCausalLM(cfg)).train()
    inputs, target = token_batch(seed=seed)
    w = workload(model, (inputs,), target, lambda out, t: lm_loss(out[0], t) + coef * out[1])
    # the aux loss mixes every row, so the batch dim cannot be found from the graph alone
    return {**w, "batch_dims": (0, 0)}
