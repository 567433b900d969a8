"""Memory per GPU of one pipeline stage: weights, gradients, optimizer state, activations.

16 bytes per local parameter (fp16 weights and grads, fp32 master weights and two Adam
moments), plus the activations the schedule keeps in flight: how many (chunk, microbatch)
a stage holds is the runtime's own bound for the schedule it will run
(`runtime.schedule.inflight_bound`; 1F1B min(p-r, m), interleaved its warm-up plus one).
Per layer and microbatch that is the layer input (2sbh) with recomputation, or
sbh(10 + 24/t + 5as/(ht)) without (Korthikanti et al. 2022, sec. 4.1), plus one layer's full
activations while it is recomputed, plus the logits on the last stage.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from threefold.planner.model_cost import BYTES_PER_PARAM, ModelCost
from threefold.runtime.schedule import inflight_bound

if TYPE_CHECKING:
    from threefold.planner.estimate import Config


def stage_params(model: ModelCost, n_layers: int, stage: int, pp: int, tp: int) -> float:
    """Parameters one GPU of this stage holds."""
    split = model.layer_params - model.layer_params_repl
    params = n_layers * (split / tp + model.layer_params_repl)
    if stage == 0:
        params += model.pre_params / tp + model.pre_params_repl
    if stage == pp - 1:
        params += model.post_params / tp + model.post_params_repl
        if model.tied_embedding and pp > 1:
            params += model.pre_params / tp     # Megatron keeps a copy of the word embedding
    return params


def stage_memory(model: ModelCost, cfg: Config, stage: int, n_layers: int, params: float) -> float:
    t, p, v, b = cfg.tp, cfg.pp, cfg.interleave, cfg.microbatch_size
    tokens = b * model.seq_len
    full_layer = (model.act_split / t + model.act_repl) * tokens
    chunks = inflight_bound(cfg.plan.schedule, p, cfg.microbatches, v)[stage]
    layers_per_chunk = math.ceil(n_layers / v)
    if cfg.recompute:
        # Inputs of every in-flight layer, plus the one layer being recomputed.
        acts = chunks * layers_per_chunk * model.act_input * tokens + full_layer
    else:
        acts = chunks * layers_per_chunk * full_layer
    if stage == p - 1:
        acts += model.post_act * tokens / (t if model.post_act_split else 1)
    return params * BYTES_PER_PARAM + acts
